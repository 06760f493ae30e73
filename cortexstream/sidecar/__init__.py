"""Force-matched sidecar: learned coarse-graining of the KV cache (issue #8).

A window of N cached (key, value) pairs of one KV head is replaced by one synthesised bead that pulls future
queries the way the whole window did (value and Jacobian of the attention output in the query).

- `network`: `SidecarNet` (set encoder + learned attention pooling; 140k parameters at SmolLM2's shape with the
  default d_model 64 x 2 layers, 0.71M at 128 x 3) and
  `SidecarNet.beads(keys [H, W, N, D], values, layer) -> (k_bead [H, W, D], v_bead)` for policies
  (`layer=None`: all layers at once, [L, H, W, N, D]).
- `porting`: `save_sidecar` / `load_sidecar` (our safetensors) and `load_torch_sidecar` (a PyTorch state dict).
- `shipped`: the weights in `weights/` (found by their stored config) and a per-process cache of loaded networks.
- Training lives apart, in `cortexstream.training.sidecar`: `trajectories` (`collect_trajectories`, frozen model,
  real text -> chunked row files; `TrajectoryStore`), `loss` (`force_matching_loss`, Jacobian by MLX autodiff,
  Hutchinson or exact), `train` (`train_sidecar` on the shared loop of `cortexstream.training.loop`), `heldout`
  (exact held-out losses vs mean pooling, export of shippable weights), `compare` (a quick perplexity/needle
  comparison of policies); its text (disjoint from what `bench quality` evaluates) is `cortexstream.training.text`.
- The KV policy is `cortexstream.policies.Sidecar`; the CLI is `cortexstream train sidecar`.

Bead position (RoPE). Cached keys are post-RoPE and are never re-rotated (mlx-lm rotates a key once, when it is
written, at the cache's logical offset). A bead is a post-RoPE key like the others: it is written into the slot
range its window occupied and is not rotated again; it has no position of its own. Its relative-position
information is whatever the window's rotated keys carried: for the first-order part this is exact by linearity
(q_t . sum_j a_j k_j = sum_j a_j q_t . k_j at every query position t), and the trajectories train the learned
corrections against queries at their real distances. Consequences for a policy: the logical offset (RoPE position
of new tokens) keeps counting original tokens, not slots (the arena already separates `offset` from `size()`),
and beads must not be moved through a re-rotation (e.g. StreamingLLM-style position re-indexing).

Bead mass. A bead stands for N tokens, so it carries a log-multiplicity beta (about log N, exactly the entropy of
its pooling weights at first order; see `network`), added to its attention logit. `mx.fast.scaled_dot_product_attention`
takes an additive float mask broadcastable to [B, Hq, L, K], which can express a per-key bias, but mlx-lm models
build one mask per forward pass from the first layer's cache and share it across layers, so a per-layer/per-head
bias cannot travel through the model's mask. It can travel through the SDPA hook of
`cortexstream.engine.attention_hook`: a cache with an `attention_hook` receives (queries, keys, values, scale,
mask, sinks) and calls the original SDPA with `mask + bias`, where bias is [1, Hq, 1, K] (beta of each bead at
its slot, repeated over the GQA group, 0 elsewhere; a "causal" string mask becomes an additive array first).
`SidecarNet.beads_with_mass` returns beta for that. A policy that cannot add the bias needs weights trained with
`log_mass=False`, whose beads must absorb the mass into the key (beta fixed at 0); such weights fit the
per-window losses clearly worse, so the mass term is the default. End to end, in perplexity, a bead that stands
in well for its window alone is only level with mean pooling without mass, and worse than H2O at the same cache
size: the per-window loss does not see the errors of many massive beads adding up in one softmax, and training on
queries against many beads at once is the likely fix (not yet tried). Figures: `weights/README.md` (held-out
losses of the shipped weights), docs/policies.md and docs/performance.md (perplexity against the other policies).
"""

from cortexstream.sidecar.network import SidecarConfig, SidecarNet
from cortexstream.sidecar.porting import load_sidecar, load_torch_sidecar, save_sidecar

__all__ = ["SidecarConfig", "SidecarNet", "load_sidecar", "load_torch_sidecar", "save_sidecar"]
