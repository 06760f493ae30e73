"""The C2C distillation task: examples (what the sharer and receiver saw, what the oracle predicts) and the loss.

Task (one example = consecutive tokens `A | B | T` of real text):
- the *sharer* reads `A + B[:-1]`; its cache at the `B[:-1]` positions carries what it learnt from `A`;
- the *receiver* reads only `B[:-1]` (it never saw `A`); the fuser fuses the sharer's `B[:-1]` cache into it;
- the receiver then reads `B[-1], T[:-1]` on the fused cache (the paper's recipe: fuse the prompt but its last
  token, compute the last token on the fused cache) and predicts `T`;
- the *oracle* is the receiver itself having read all of `A + B`: its next-token distributions over `T` and its
  final hidden states are the targets. Loss = KL(oracle || fused receiver) per token (logit distillation) plus
  `align_weight` x state alignment (normalised MSE or 1 - cosine of the final hidden states).
A fuser that transfers nothing leaves the KL at its no-fusion value. The floor is above 0: the oracle's `T` tokens
attend to `A`'s own keys, which the fused receiver does not hold; only what `B`'s cache absorbed from `A` can be
handed over. Same model, the best cache over `B` is the sharer's own (K rotated back by the fixed RoPE offset
|A|); the tests check that this copy reproduces the oracle's `B` cache exactly and lowers the KL.

Positions: the receiver's `B` starts at position 0, the sharer's at |A|. |A| is fixed per run (train and eval
alike), so the offset is a fixed rotation a fuser can learn; a different |A| at serving time is out of
distribution. For two tokenizers, `sharer_ids` are the receiver's ids mapped one-to-one (`TokenAligner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from cortexstream.c2c.fusion import LayerKV
from cortexstream.errors import InvalidArgumentError


@dataclass(frozen=True)
class Split:
    """Token counts: context only the sharer sees, the shared bridge, and the scored continuation."""

    context: int = 96
    bridge: int = 32
    target: int = 32

    def __post_init__(self) -> None:
        if self.context < 1 or self.bridge < 2 or self.target < 1:
            raise InvalidArgumentError(f"split: context {self.context} >= 1, bridge {self.bridge} >= 2 and "
                                       f"target {self.target} >= 1 required")

    @property
    def length(self) -> int:
        return self.context + self.bridge + self.target


class ArrayCache:
    """A layer cache over given `(K, V)` arrays that grows by concatenation, so gradients reach those arrays
    (mlx-lm's KVCache writes into preallocated buffers). Used for teacher-forced training forwards."""

    def __init__(self, keys: mx.array, values: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


def hidden_states(model: Any, ids: mx.array, cache: list[Any]) -> mx.array:
    """Final (normed) hidden states `[B, N, hidden]` of an mlx-lm model, the input of its LM head."""
    return model.model(ids, cache=cache)


def lm_logits(model: Any, hidden: mx.array) -> mx.array:
    head = getattr(model, "lm_head", None)
    return head(hidden) if head is not None else model.model.embed_tokens.as_linear(hidden)


def _layers(cache: list[Any], lo: int, hi: int) -> list[LayerKV]:
    out = []
    for c in cache:
        k, v = c.state[0], c.state[1]
        out.append((k[..., lo:hi, :], v[..., lo:hi, :]))
    return out


def make_example(receiver: Any, sharer: Any, ids: Sequence[int], sharer_ids: Sequence[int], split: Split
                 ) -> dict[str, Any]:
    """Everything a training/eval step needs for one `A | B | T` window, evaluated (no graph kept)."""
    if len(ids) != split.length or len(sharer_ids) != split.length:
        raise InvalidArgumentError(f"make_example: {len(ids)}/{len(sharer_ids)} ids for a split of {split.length}")
    a, b = split.context, split.bridge
    head = a + b - 1  # tokens read before the receiver's last prompt token
    arr = mx.array(list(ids), dtype=mx.uint32)[None]
    inputs, targets = arr[:, head : head + split.target], arr[:, head + 1 :]
    oracle_cache = [KVCache() for _ in receiver.layers]
    receiver(arr[:, :head], cache=oracle_cache)
    oracle_hidden = hidden_states(receiver, inputs, oracle_cache)
    same = sharer is receiver and list(sharer_ids) == list(ids)
    if same:  # the donor is the receiver itself: its cache is the oracle's, no second forward needed
        src = _layers(oracle_cache, a, head)
    else:
        sharer_cache = [KVCache() for _ in sharer.layers]
        sharer(mx.array(list(sharer_ids[:head]), dtype=mx.uint32)[None], cache=sharer_cache)
        src = _layers(sharer_cache, a, head)
    tgt_cache = [KVCache() for _ in receiver.layers]
    receiver(arr[:, a:head], cache=tgt_cache)
    tgt = _layers(tgt_cache, 0, b - 1)
    plain_hidden = hidden_states(receiver, inputs, tgt_cache)  # the no-fusion baseline, for evaluation
    example = {"src": src, "tgt": tgt, "inputs": inputs,
               "targets": targets, "oracle_hidden": oracle_hidden, "plain_hidden": plain_hidden}
    mx.eval(example["src"], tgt, inputs, targets, oracle_hidden, plain_hidden)
    # Copies of the slices: a view would keep each whole KVCache buffer alive.
    example["src"] = [(k * 1, v * 1) for k, v in example["src"]]
    example["tgt"] = [(k * 1, v * 1) for k, v in tgt]
    mx.eval(example["src"], example["tgt"])
    return example


def stack(examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Examples of one split stacked along the batch axis."""
    def cat(get: Any) -> mx.array:
        return mx.concatenate([get(e) for e in examples], axis=0)

    n_src, n_tgt = len(examples[0]["src"]), len(examples[0]["tgt"])
    return {
        "src": [(cat(lambda e, i=i: e["src"][i][0]), cat(lambda e, i=i: e["src"][i][1])) for i in range(n_src)],
        "tgt": [(cat(lambda e, i=i: e["tgt"][i][0]), cat(lambda e, i=i: e["tgt"][i][1])) for i in range(n_tgt)],
        **{name: cat(lambda e, n=name: e[n]) for name in ("inputs", "targets", "oracle_hidden", "plain_hidden")},
    }


def fused_forward(receiver: Any, fused: Sequence[LayerKV], inputs: mx.array) -> mx.array:
    """Receiver hidden states over `inputs`, reading the fused prompt cache (differentiable in `fused`)."""
    return hidden_states(receiver, inputs, [ArrayCache(k, v) for k, v in fused])


def distill_terms(receiver: Any, hidden: mx.array, oracle_hidden: mx.array, targets: mx.array
                  ) -> dict[str, mx.array]:
    """Per-batch means: KL(oracle || student) in nats/token, student NLL of `targets`, normalised MSE and
    1 - cosine of the hidden states."""
    log_p = lm_logits(receiver, oracle_hidden).astype(mx.float32)
    log_p = log_p - mx.logsumexp(log_p, axis=-1, keepdims=True)
    log_q = lm_logits(receiver, hidden).astype(mx.float32)
    log_q = log_q - mx.logsumexp(log_q, axis=-1, keepdims=True)
    kl = (mx.exp(log_p) * (log_p - log_q)).sum(-1).mean()
    nll = -mx.take_along_axis(log_q, targets[..., None].astype(mx.int32), axis=-1).mean()
    mse = ((hidden - oracle_hidden) ** 2).mean() / (oracle_hidden**2).mean()
    cos = (hidden * oracle_hidden).sum(-1) / (mx.linalg.norm(hidden, axis=-1) * mx.linalg.norm(oracle_hidden, axis=-1)
                                              + 1e-6)
    return {"kl": kl, "nll": nll, "mse": mse, "cos": 1 - cos.mean()}
