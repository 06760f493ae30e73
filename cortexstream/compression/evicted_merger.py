"""A learned merger of evicted tokens: the FastCache compressor's MLPs retrained to fold what eviction drops into
the kept token it most resembles (after CaM / D2O, with the fold learned instead of a fixed average).

An evicting policy (H2O's choice) keeps some slots per layer and KV head. Each dropped slot is matched to the kept
slot of its head whose key is most similar (cosine); it joins that slot's group when the cosine reaches
`threshold`. A kept slot with a group becomes one token made from two: the anchor (its own key and value) and the
group's mean (keys and values weighted by each member's cosine, as D2O weighs them). That pair goes through the
layer's text-K and text-V MLPs of a factor-2 `KVCompressor` as one window [anchor, mean], token-major, so the
network is the shipped compressor's architecture and file format, used as a residual: the new token is the anchor
plus the MLPs' output. A kept slot without a group stays as it is.

`anchor_init` zeroes the MLPs' last layers, so an untrained merger is the eviction policy itself (H2O) and
training only learns what to fold in. `group_means` is the same code at training time
(batched, [B, H, n, D]) and at run time (one sequence, [H, n, D]).
"""

from __future__ import annotations

import mlx.core as mx

from cortexstream.compression.compressor import CompressorConfig, KVCompressor
from cortexstream.errors import InvalidArgumentError

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
    unit = k32 / mx.maximum(mx.linalg.norm(k32, axis=-1, keepdims=True), 1e-6)
    unit_kept = mx.take_along_axis(unit, index[..., None], axis=-2)
    sim = unit @ unit_kept.swapaxes(-1, -2)  # [..., H, n, k]
    best = mx.argmax(sim, axis=-1)
    weight = mx.max(sim, axis=-1)
    kept = mx.zeros(index.shape[:-1] + (n,), mx.bool_)
    kept = mx.put_along_axis(kept, index, mx.array(True), axis=-1)
    weight = mx.where(mx.logical_and(mx.logical_not(kept), weight >= threshold), weight, 0.0)
    assign = (mx.arange(index.shape[-1]) == best[..., None]).astype(mx.float32) * weight[..., None]  # [..., n, k]
    assign = mx.stop_gradient(assign)
    total = assign.sum(axis=-2)  # [..., H, k]
    denom = mx.maximum(total, 1e-6)[..., None]
    has = (total > 0)[..., None]
    mean_k = mx.where(has, (assign.swapaxes(-1, -2) @ k32) / denom, anchor_k)
    mean_v = mx.where(has, (assign.swapaxes(-1, -2) @ v32) / denom, anchor_v)
    return anchor_k, anchor_v, mean_k, mean_v, total, (weight > 0).sum()


def d2o_fold(anchor_v: mx.array, mean_v: mx.array, weight: mx.array) -> mx.array:
    """D2O's untrained fold of the values: (v_anchor + W * mean) / (1 + W), keys unchanged (the baseline)."""
    w = weight[..., None]
    return (anchor_v + w * mean_v) / (1.0 + w)


def learned_fold(merger: KVCompressor, layer: int, anchor_k: mx.array, anchor_v: mx.array, mean_k: mx.array,
                 mean_v: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """The merger's fold where a group exists: anchor + MLP([anchor, mean]) (a residual: the MLP learns the
    correction); the anchor elsewhere."""
    check_merger(merger, "merger")
    pair_k = mx.concatenate([anchor_k[..., None, :], mean_k[..., None, :]], axis=-2)
    pair_v = mx.concatenate([anchor_v[..., None, :], mean_v[..., None, :]], axis=-2)
    shape = anchor_k.shape
    flat_k = pair_k.reshape(*shape[:-2], shape[-2] * FACTOR, shape[-1])
    flat_v = pair_v.reshape(*shape[:-2], shape[-2] * FACTOR, anchor_v.shape[-1])
    delta_k, delta_v = merger.merge_windows(flat_k, flat_v, layer)
    has = (weight > 0)[..., None]
    return (mx.where(has, anchor_k + delta_k.astype(mx.float32), anchor_k),
            mx.where(has, anchor_v + delta_v.astype(mx.float32), anchor_v))


def check_merger(merger: KVCompressor, source: str) -> None:
    if merger.config.factor != FACTOR:
        raise InvalidArgumentError(f"{source}: a merger of evicted tokens has factor {FACTOR} ([anchor, group "
                                   f"mean]), these weights merge {merger.config.factor} tokens")


def load_merger(path: str) -> KVCompressor:
    """A merger from a safetensors file written by `cortexstream train merger` (its metadata says `merges:
    evicted`); a window compressor's file is refused, since its MLPs compute something else."""
    from cortexstream.port import load_checkpoint
    from cortexstream.port.finite import check_finite

    ckpt = load_checkpoint(path)
    if (ckpt.metadata or {}).get("merges") != MERGES:
        raise InvalidArgumentError(f"weights: '{path}' is not a merger of evicted tokens (no 'merges: {MERGES}' in "
                                   "its metadata; a window compressor's weights merge windows). Train one with "
                                   "`cortexstream train merger`")
    check_finite(ckpt.tensors, path)
    merger = KVCompressor.from_state_dict(ckpt.tensors, source=path)
    check_merger(merger, path)
    return merger


def new_merger(num_layers: int, head_dim: int) -> KVCompressor:
    """An untrained merger (text MLPs only, no dropout); call `anchor_init` before training."""
    return KVCompressor(CompressorConfig(num_layers, head_dim, FACTOR, image=False, dropout=0.0))


def anchor_init(merger: KVCompressor) -> None:
    """Zero the last Linear of every MLP: the residual fold then returns the anchor exactly (plain eviction), and
    training starts from the eviction policy itself. The other layers keep their random initialisation, so the
    first steps' gradients reach them through the last layer (a residual network, unlike the window compressor's
    mean-pooling start, whose ReLU shift makes every weight too sensitive for a useful learning rate)."""
    for layer in range(merger.config.num_layers):
        for mlp in (merger.compress_tk[layer], merger.compress_tv[layer]):
            mlp[6].weight = mx.zeros_like(mlp[6].weight)
            mlp[6].bias = mx.zeros_like(mlp[6].bias)
    mx.eval(merger.parameters())


__all__ = ["FACTOR", "MERGES", "anchor_init", "check_merger", "d2o_fold", "group_means", "learned_fold",
           "new_merger"]
