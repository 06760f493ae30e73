"""Training objective for KV compressors: the model run on query tokens over a compressed prefix cache.

The student cache is laid out exactly as the `Compressor` KV policy leaves a sequence of P tokens between forward
passes: `sinks` raw tokens, then w = (P - sinks - recent) // factor merged windows, then the raw tail (the last
`recent` tokens plus fewer than `factor` not yet merged). `PrefixCache` serves that prefix to the model: its
`offset` is the true prefix length P, so the query tokens get their real RoPE positions although there are fewer
physical keys, and it concatenates instead of writing in place, so gradients flow from the logits back into the
compressed keys and values (and from there into the compressor's MLPs).

Loss: KL(full-cache next-token distribution || compressed-cache distribution) averaged over the query tokens, plus
an optional MSE between the two final hidden states. Baselines (mean pooling, mean pooling with a log(factor)
logit bias, evicting the merged range) use the same layout, so their losses are directly comparable.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

# (layer, keys [B, H, N, D], values) -> (merged keys [B, H, N / factor, D], merged values)
MergeFn = Callable[[int, mx.array, mx.array], tuple[mx.array, mx.array]]


class PrefixCache:
    """A differentiable mlx-lm-style cache: fixed prefix K/V (maybe compressed) + the tokens of one forward pass.

    bias: additive attention-logit bias for each prefix slot `[N_prefix]` (e.g. log-mass), or None.
    """

    def __init__(self, keys: mx.array, values: mx.array, offset: int, bias: mx.array | None = None) -> None:
        self.keys, self.values, self.offset, self.bias = keys, values, int(offset), bias

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += keys.shape[2]
        self.fetched = (mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2))
        return self.fetched

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, offset: int, dtype: Any) -> "PrefixCache":
        """No prefix, positions starting at `offset` (the teacher's shifted segments)."""
        return cls(mx.zeros((batch, heads, 0, head_dim), dtype), mx.zeros((batch, heads, 0, head_dim), dtype), offset)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None:
            raise ValueError("PrefixCache: sliding-window layers are not supported for compressor training")
        if self.bias is None:
            # mx.fast SDPA aligns a "causal" mask to the bottom right, which is right for prefix + new tokens
            return "causal" if n > 1 else None
        prefix = self.keys.shape[2]
        causal = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        new = mx.where(causal, 0.0, -math.inf).astype(self.keys.dtype)
        old = mx.broadcast_to(self.bias.astype(self.keys.dtype)[None], (n, prefix))
        return mx.concatenate([old, new], axis=1)


def layout(prefix: int, sinks: int, recent: int, factor: int) -> tuple[int, int]:
    """(start, end) of the merged range of a P-token prefix, as the policy leaves it between forward passes."""
    windows = max(0, (prefix - sinks - recent) // factor)
    return sinks, sinks + windows * factor


def compress_prefix(keys: mx.array, values: mx.array, layer: int, merge: MergeFn | None, *, sinks: int,
                    recent: int, factor: int) -> tuple[mx.array, mx.array, mx.array]:
    """[B, H, P, D] K/V -> (keys, values, mass [P']) with the merged range replaced by `merge` (None: evicted)."""
    p = keys.shape[2]
    start, end = layout(p, sinks, recent, factor)
    n_merged = (end - start) // factor if merge is not None else 0
    mass = mx.concatenate([mx.ones((start,)), mx.full((n_merged,), float(factor)), mx.ones((p - end,))])
    if end == start:
        return keys, values, mx.ones((p,))
    parts_k, parts_v = [keys[:, :, :start]], [values[:, :, :start]]
    if merge is not None:
        mk, mv = merge(layer, keys[:, :, start:end], values[:, :, start:end])
        parts_k.append(mk)
        parts_v.append(mv)
    parts_k.append(keys[:, :, end:])
    parts_v.append(values[:, :, end:])
    return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2), mass


def mean_pool(factor: int) -> MergeFn:
    """The untrained baseline: each window of `factor` tokens becomes the mean of its keys and of its values."""

    def merge(layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, n, d = keys.shape
        return (keys.reshape(b, h, n // factor, factor, d).mean(axis=3),
                values.reshape(b, h, n // factor, factor, d).mean(axis=3))

    return merge


def logits_of(model: Any, hidden: mx.array) -> mx.array:
    """The vocabulary projection of mlx-lm models (tied embeddings or an lm_head)."""
    head = getattr(model, "lm_head", None)
    return head(hidden) if head is not None else model.model.embed_tokens.as_linear(hidden)


def student_forward(model: Any, prefix_kv: Sequence[tuple[mx.array, mx.array]], queries: mx.array,
                    merge: MergeFn | None, *, sinks: int, recent: int, factor: int,
                    log_mass_bias: bool = False, offset: int = 0) -> mx.array:
    """Final hidden states `[B, Q, hidden]` of the query tokens over the compressed prefix cache; `offset`: the
    position of the prefix's first token (0 unless the segment was run shifted)."""
    caches = []
    for layer, (k, v) in enumerate(prefix_kv):
        ck, cv, mass = compress_prefix(k, v, layer, merge, sinks=sinks, recent=recent, factor=factor)
        caches.append(PrefixCache(ck, cv, offset + k.shape[2], mx.log(mass) if log_mass_bias else None))
    return model.model(queries, cache=caches)


def kl_divergence(teacher_logp: mx.array, student_logits: mx.array) -> mx.array:
    """Mean over tokens of KL(teacher || student); teacher given as log-probabilities `[..., V]`."""
    student_logp = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)
    return (mx.exp(teacher_logp) * (teacher_logp - student_logp)).sum(axis=-1).mean()


def hidden_over_offsets(batch: dict[str, Any], forward: Callable[[mx.array | None, int], mx.array]) -> mx.array:
    """Final hidden states of a batch's query tokens, one `forward(rows, offset)` per position offset (RoPE takes
    one offset per call); rows None: the whole batch. Reassembled in the batch's order."""
    offsets = [int(o) for o in batch.get("offsets", [0] * batch["queries"].shape[0])]
    parts, order = [], []
    for offset in sorted(set(offsets)):
        rows = [i for i, o in enumerate(offsets) if o == offset]
        parts.append(forward(mx.array(rows) if len(rows) < len(offsets) else None, offset))
        order += rows
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)[mx.array(np.argsort(order))]


def distillation_loss(model: Any, batch: dict[str, Any], hidden: mx.array,
                      mse_weight: float = 0.0) -> tuple[mx.array, mx.array, mx.array]:
    """(loss, kl, mse) of the student's final hidden states against the batch's teacher."""
    kl = kl_divergence(batch["teacher_logp"], logits_of(model, hidden).astype(mx.float32))
    mse = ((hidden - batch["teacher_hidden"]) ** 2).mean()
    return kl + mse_weight * mse, kl, mse


def compression_loss(model: Any, batch: dict[str, Any], merge: MergeFn | None, *, sinks: int, recent: int,
                     factor: int, mse_weight: float = 0.0,
                     log_mass_bias: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """(loss, kl, mse) for a batch holding `prefix_kv`, `queries` [B, Q], `teacher_logp` and `teacher_hidden`."""
    def forward(idx: mx.array | None, offset: int) -> mx.array:
        kv = batch["prefix_kv"] if idx is None else [(k[idx], v[idx]) for k, v in batch["prefix_kv"]]
        queries = batch["queries"] if idx is None else batch["queries"][idx]
        return student_forward(model, kv, queries, merge, sinks=sinks, recent=recent, factor=factor,
                               log_mass_bias=log_mass_bias, offset=offset)

    return distillation_loss(model, batch, hidden_over_offsets(batch, forward), mse_weight)
