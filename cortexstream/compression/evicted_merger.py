"""A learned merger of evicted tokens: the FastCache compressor's MLPs retrained to fold what eviction drops into
the kept token it most resembles (after CaM / D2O, with the fold learned instead of a fixed average).

An evicting policy (H2O's choice) keeps some slots per layer and KV head. Each dropped slot is matched to the kept
slot of its head whose key is most similar (cosine); it joins that slot's group when the cosine reaches
`threshold`. A kept slot with a group becomes one token made from two: the anchor (its own key and value) and the
group's mean (keys and values weighted by each member's cosine, as D2O weighs them). That pair goes through the
layer's text-K and text-V MLPs of a factor-2 `KVCompressor` as one window [anchor, mean], token-major, so the
network is the shipped compressor's architecture and file format, used as a residual: the new token is the anchor
plus the MLPs' output. A kept slot without a group stays as it is.

The sidecar's set encoder can be retrained the same way (`network="sidecar"`): the pair [anchor, mean] is a
window of two tokens and its bead (key, value) replaces the kept slot. Its log-mass is off (`log_mass=False`):
an evicting policy's kept slot is folded again at later evictions, and a bias set once would not follow.

`anchor_init` zeroes the MLPs' last layers, so an untrained compressor merger is the eviction policy itself (H2O)
and training only learns what to fold in (an untrained sidecar merger gives its attention-pooled bead of the
pair). `group_means` is the same code at training time (batched, [B, H, n, D]) and at run time (one sequence,
[H, n, D]).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Mapping, Union

import mlx.core as mx

from cortexstream.compression.compressor import CompressorConfig, KVCompressor
from cortexstream.errors import InvalidArgumentError
from cortexstream.sidecar.network import SidecarConfig, SidecarNet


class MergerNetwork(str, Enum):
    COMPRESSOR = "compressor"
    SIDECAR = "sidecar"


Merger = Union[KVCompressor, SidecarNet]
# (layer, anchor_k, anchor_v, mean_k, mean_v, weight) -> new (keys, values) of the kept slots, from `group_means`
Fold = Callable[[int, mx.array, mx.array, mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]

# A marker in the file's metadata: these weights fold evicted tokens, they do not merge windows.
MERGES = "evicted"
FACTOR = 2  # the window of the MLPs: [anchor, group mean]


def group_means(keys: mx.array, values: mx.array, keep: mx.array,
                threshold: float) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]:
    """Fold groups for slots `keep` `[..., H, k]` (int, ascending or not) of keys/values `[..., H, n, D]`.

    Returns (anchor_keys, anchor_values [..., H, k, D], mean_keys, mean_values [..., H, k, D], weight [..., H, k]):
    the kept slots, the cosine-weighted mean of the dropped slots in each one's group (the anchor itself where the
    group is empty), the group's total weight (0: no group), and how many dropped slots joined a group (a scalar).
    Selection is not differentiable; the means are.
    """
    n = keys.shape[-2]
    k32, v32 = keys.astype(mx.float32), values.astype(mx.float32)
    index = keep.astype(mx.int32)
    anchor_k = mx.take_along_axis(k32, index[..., None], axis=-2)
    anchor_v = mx.take_along_axis(v32, index[..., None], axis=-2)
    dropped = n - index.shape[-1]
    if dropped <= 0:
        total = mx.zeros(index.shape, mx.float32)
        return anchor_k, anchor_v, anchor_k, anchor_v, total, mx.array(0)
    # Only the dropped slots are compared with the kept ones (one per head while decoding, not the whole cache).
    kept = mx.zeros(index.shape[:-1] + (n,), mx.int32)
    kept = mx.put_along_axis(kept, index, mx.array(1, mx.int32), axis=-1)
    drop = mx.stop_gradient(mx.argsort(kept, axis=-1)[..., :dropped])  # [..., H, d]: the slots not kept
    drop_k = mx.take_along_axis(k32, drop[..., None], axis=-2)
    drop_v = mx.take_along_axis(v32, drop[..., None], axis=-2)
    unit_kept = anchor_k / mx.maximum(mx.linalg.norm(anchor_k, axis=-1, keepdims=True), 1e-6)
    unit_drop = drop_k / mx.maximum(mx.linalg.norm(drop_k, axis=-1, keepdims=True), 1e-6)
    sim = unit_drop @ unit_kept.swapaxes(-1, -2)  # [..., H, d, k]
    best = mx.argmax(sim, axis=-1)
    weight = mx.max(sim, axis=-1)
    weight = mx.where(weight >= threshold, weight, 0.0)
    assign = (mx.arange(index.shape[-1]) == best[..., None]).astype(mx.float32) * weight[..., None]  # [..., d, k]
    assign = mx.stop_gradient(assign)
    total = assign.sum(axis=-2)  # [..., H, k]
    denom = mx.maximum(total, 1e-6)[..., None]
    has = (total > 0)[..., None]
    mean_k = mx.where(has, (assign.swapaxes(-1, -2) @ drop_k) / denom, anchor_k)
    mean_v = mx.where(has, (assign.swapaxes(-1, -2) @ drop_v) / denom, anchor_v)
    return anchor_k, anchor_v, mean_k, mean_v, total, (weight > 0).sum()


def d2o_fold(anchor_v: mx.array, mean_v: mx.array, weight: mx.array) -> mx.array:
    """D2O's untrained fold of the values: (v_anchor + W * mean) / (1 + W), keys unchanged (the baseline)."""
    w = weight[..., None]
    return (anchor_v + w * mean_v) / (1.0 + w)


def learned_fold(merger: Merger, layer: int, anchor_k: mx.array, anchor_v: mx.array, mean_k: mx.array,
                 mean_v: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """The merger's fold where a group exists, the anchor elsewhere: a compressor gives anchor + MLP([anchor,
    mean]) (a residual: the MLP learns the correction), a sidecar the bead of the pair."""
    check_merger(merger, "merger")
    has = (weight > 0)[..., None]
    if isinstance(merger, SidecarNet):
        heads = anchor_k.shape[-3]
        pair_k = mx.stack([anchor_k, mean_k], axis=-2)
        pair_v = mx.stack([anchor_v, mean_v], axis=-2)
        group = mx.broadcast_to((layer * heads + mx.arange(heads))[:, None], anchor_k.shape[-3:-1])
        bead_k, bead_v, _ = merger(pair_k, pair_v, mx.broadcast_to(group, anchor_k.shape[:-1]))
        return mx.where(has, bead_k, anchor_k), mx.where(has, bead_v, anchor_v)
    pair_k = mx.concatenate([anchor_k[..., None, :], mean_k[..., None, :]], axis=-2)
    pair_v = mx.concatenate([anchor_v[..., None, :], mean_v[..., None, :]], axis=-2)
    shape = anchor_k.shape
    flat_k = pair_k.reshape(*shape[:-2], shape[-2] * FACTOR, shape[-1])
    flat_v = pair_v.reshape(*shape[:-2], shape[-2] * FACTOR, anchor_v.shape[-1])
    delta_k, delta_v = merger.merge_windows(flat_k, flat_v, layer)
    return (mx.where(has, anchor_k + delta_k.astype(mx.float32), anchor_k),
            mx.where(has, anchor_v + delta_v.astype(mx.float32), anchor_v))


def check_merger(merger: Merger, source: str) -> None:
    if isinstance(merger, SidecarNet):
        if merger.config.window < FACTOR or merger.config.log_mass:
            raise InvalidArgumentError(f"{source}: a sidecar merger of evicted tokens takes windows of {FACTOR} "
                                       f"tokens without log-mass (window {merger.config.window}, log_mass "
                                       f"{merger.config.log_mass})")
    elif not isinstance(merger, KVCompressor):
        raise InvalidArgumentError(f"{source}: expected a KVCompressor or a SidecarNet, got {type(merger).__name__}")
    elif merger.config.factor != FACTOR:
        raise InvalidArgumentError(f"{source}: a merger of evicted tokens has factor {FACTOR} ([anchor, group "
                                   f"mean]), these weights merge {merger.config.factor} tokens")


def check_network(owner: str, network: str) -> None:
    """`network` names a `MergerNetwork`, else an error naming `owner`."""
    if network not in {n.value for n in MergerNetwork}:
        raise InvalidArgumentError(f"{owner}: network '{network}' is not one of "
                                   f"{', '.join(n.value for n in MergerNetwork)}")


def check_threshold(owner: str, threshold: float) -> None:
    """A group's mean weighs its members by their cosines (`group_means`), so the threshold that admits them must
    be a cosine in [0, 1]: a negative one would admit members whose negative weights the mean cannot carry."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InvalidArgumentError(f"{owner}: threshold {threshold!r} must be a cosine in [0, 1] for a learned "
                                   "merger (a group's mean weighs its members by their cosines)")


def network_of(merger: Merger) -> MergerNetwork:
    return MergerNetwork.SIDECAR if isinstance(merger, SidecarNet) else MergerNetwork.COMPRESSOR


def load_merger(path: str) -> Merger:
    """A merger from a safetensors file written by `cortexstream train merger` (its metadata says `merges:
    evicted`, for a compressor or a sidecar); a window compressor's or window sidecar's file is refused, since its
    network computes something else."""
    from cortexstream.port import load_checkpoint
    from cortexstream.port.finite import check_finite
    from cortexstream.sidecar.porting import META_KEY, load_sidecar, read_sidecar_info

    ckpt = load_checkpoint(path)
    meta = ckpt.metadata or {}
    merges = read_sidecar_info(path).get("merges") if META_KEY in meta else meta.get("merges")
    if merges != MERGES:
        raise InvalidArgumentError(f"weights: '{path}' is not a merger of evicted tokens (no 'merges: {MERGES}' in "
                                   "its metadata; a window compressor's or sidecar's weights merge windows). Train "
                                   "one with `cortexstream train merger`")
    check_finite(ckpt.tensors, path)
    merger: Merger = load_sidecar(path) if META_KEY in meta else KVCompressor.from_state_dict(ckpt.tensors,
                                                                                              source=path)
    check_merger(merger, path)
    return merger


def save_merger(merger: Merger, path: str, metadata: Mapping[str, Any], dtype: str | None = None) -> None:
    """Write a merger with `merges: evicted` and `metadata` (strings) in the file; dtype: the compressor's stored
    dtype (a sidecar is stored as held)."""
    from cortexstream.sidecar.porting import save_sidecar

    if isinstance(merger, SidecarNet):
        save_sidecar(merger, path, {**dict(metadata), "merges": MERGES})
    else:
        merger.save(path, dtype=dtype, metadata={**dict(metadata), "merges": MERGES})


def new_merger(network: MergerNetwork | str, num_layers: int, head_dim: int, num_kv_heads: int) -> Merger:
    """An untrained merger (call `anchor_init` before training): the compressor's text MLPs at factor 2 (no
    dropout), or a sidecar with windows of 2 and no log-mass."""
    kind = MergerNetwork(network)
    if kind is MergerNetwork.SIDECAR:
        return SidecarNet(SidecarConfig(head_dim=head_dim, window=FACTOR, num_layers=num_layers,
                                        num_kv_heads=num_kv_heads, log_mass=False))
    return KVCompressor(CompressorConfig(num_layers, head_dim, FACTOR, image=False, dropout=0.0))


def anchor_init(merger: Merger) -> None:
    """Zero the last Linear of every MLP: the residual fold then returns the anchor exactly (plain eviction), and
    training starts from the eviction policy itself. The other layers keep their random initialisation, so the
    first steps' gradients reach them through the last layer (a residual network, unlike the window compressor's
    mean-pooling start, whose ReLU shift makes every weight too sensitive for a useful learning rate). A sidecar
    is left as built (its output heads start at zero already: the attention-pooled bead of the pair)."""
    if isinstance(merger, SidecarNet):
        return
    for layer in range(merger.config.num_layers):
        for mlp in (merger.compress_tk[layer], merger.compress_tv[layer]):
            mlp[6].weight = mx.zeros_like(mlp[6].weight)
            mlp[6].bias = mx.zeros_like(mlp[6].bias)
    mx.eval(merger.parameters())


__all__ = ["FACTOR", "Fold", "MERGES", "Merger", "MergerNetwork", "anchor_init", "check_merger", "check_network",
           "check_threshold", "d2o_fold", "group_means", "learned_fold", "load_merger", "network_of", "new_merger",
           "save_merger"]
