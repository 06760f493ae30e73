"""Decode attention over quantized K/V rows: one query per sequence against codes with per-group scales and biases.

Two ways to read the codes (bench/results/kv_quant_attention.md has the measurements):
- `matmul`: never build float K/V. The G query heads of a KV head are G rows of one `mx.quantized_matmul` against
  the packed keys (scores), a precise softmax, then one `mx.quantized_matmul` of the probabilities against the
  packed values. The same arithmetic as mlx-lm's `quantized_scaled_dot_product_attention`; on Metal this is MLX's
  quantized matmul kernel, on the CPU with float32 scales it costs about what float SDPA over float rows costs.
- `dequantize`: dequantize the rows to floats, then the fused SDPA. On the CPU MLX's quantized matmul is very slow
  for float16/bfloat16 scales (15-18x float SDPA), where dequantizing first is 2.5-3x: the CPU backend picks this
  way for half-precision arenas (`backend.attention.CpuAttention.dequantize_quantized`).

A side may also be float rows (`k=int8,v=float16` keeps V in floats): that side is a plain matmul.
Rotated sides (kv_rotation.py) are read as stored: the query is rotated into the keys' space and the output out of
the values' space (one `[D, D]` product per query row), never the L stored rows. Centered sides (kv_center.py) too:
keys centered by a vector shared by all of a head's keys shift each query's scores alike, which softmax ignores;
a centered value side's output gets its center added back (the probabilities sum to one).
It lives beside the codec (kv/) because it reads `QuantizedRows`; it is plain MLX, the same on every device.
Outputs agree with SDPA over the dequantized rows to float rounding (test_quantized_attention.py).
"""

from __future__ import annotations

from typing import Any, Union

import mlx.core as mx

from cortexstream.kv.quantized_blocks import CodeView, QuantizedRows, rotate, uncenter, unrotate

Rows = Union[mx.array, QuantizedRows, CodeView]
_CODES = (QuantizedRows, CodeView)


def _floats(rows: Rows, dtype: mx.Dtype) -> mx.array:
    """Stored values (rotated for a rotated side: the caller works in its space)."""
    return rows.dequantize_stored(dtype) if isinstance(rows, _CODES) else rows


def _rotation(rows: Rows) -> mx.array | None:
    return rows.rotation if isinstance(rows, _CODES) else None


def _out_of_values(out: mx.array, values: Rows) -> mx.array:
    """Attention output computed in the values' stored space, back in theirs (un-rotated, center added)."""
    if not isinstance(values, _CODES):
        return out
    out = unrotate(out, values.rotation)
    if values.center is None:
        return out
    center = values.center  # [1, H, 1, D]
    if out.ndim == 4 and out.shape[1] != center.shape[1]:  # [B, Hq, 1, D] outputs: query head h*G+g reads KV head h
        group = out.shape[1] // center.shape[1]
        center = mx.repeat(center, group, axis=1)
    return uncenter(out, center)


def decode_attention(queries: mx.array, keys: Rows, values: Rows, scale: float, mask: Any = None,
                     dequantize: bool = False) -> mx.array:
    """Attention of `queries` `[B, Hq, 1, D]` over `keys`/`values` (`[B, H, L, D]` floats or `QuantizedRows` of
    that shape, B = 1 for a container) -> `[B, Hq, 1, DV]`. `mask`: None, or a boolean / additive array
    broadcastable to `[B, 1, 1, L]` (a batch's padding). `dequantize`: read codes by dequantizing first."""
    queries = rotate(queries, _rotation(keys))
    if dequantize or not (isinstance(keys, _CODES) or isinstance(values, _CODES)):
        out = mx.fast.scaled_dot_product_attention(queries, _floats(keys, queries.dtype),
                                                   _floats(values, queries.dtype), scale=scale, mask=mask)
        return _out_of_values(out, values)
    batch, q_heads, num_queries, dim = queries.shape
    heads = keys.num_heads if isinstance(keys, _CODES) else keys.shape[1]
    if num_queries != 1 or q_heads % heads:
        raise ValueError(f"decode_attention: queries {tuple(queries.shape)} must be one per sequence, with query "
                         f"heads a multiple of the {heads} KV heads")
    group = q_heads // heads
    # query head h * G + g reads KV head h (mlx-lm's GQA mapping); scaled first, as the fused SDPA does
    q = (queries * mx.array(scale, queries.dtype)).reshape(batch, heads, group, dim)
    scores = _matmul(q, keys, transpose=True)  # [B, H, G, L]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = _out_of_values(_matmul(probs.astype(queries.dtype), values, transpose=False), values)  # [B, H, G, DV]
    return out.reshape(batch, q_heads, 1, -1).astype(queries.dtype)


def decode_attention_per_head(queries: mx.array, keys: Rows, values: Rows, scale: float) -> mx.array:
    """`decode_attention` of one sequence (`queries` `[1, Hq, 1, D]`, rows `[1, H, L, ...]` slices of a run) with
    one pair of products per KV head over its `[L, ...]` rows. A run's rows of one head are contiguous in the
    arena, while its rows of all heads are not, and MLX's quantized matmul copies a non-contiguous operand first:
    at long runs that copy costs more than the extra calls (bench/results/kv_quant_attention.md)."""
    _, q_heads, _, dim = queries.shape
    heads = keys.num_heads if isinstance(keys, _CODES) else keys.shape[1]
    group = q_heads // heads
    q = rotate(queries * mx.array(scale, queries.dtype), _rotation(keys)).reshape(heads, group, dim)
    outs = []
    for head in range(heads):
        scores = _matmul(q[head], _head(keys, head), transpose=True)  # [G, L]
        probs = mx.softmax(scores, axis=-1, precise=True).astype(queries.dtype)
        outs.append(_matmul(probs, _head(values, head), transpose=False))  # [G, DV]
    out = _out_of_values(mx.stack(outs)[None], values)  # [1, H, G, DV]
    return out.reshape(1, q_heads, 1, -1).astype(queries.dtype)


def _head(rows: Rows, head: int) -> Rows:
    """One KV head's rows `[L, ...]` of a single sequence's `[1, H, L, ...]` rows (views, no copy)."""
    if isinstance(rows, _CODES):
        return CodeView(rows.packed[0, head], rows.scales[0, head], rows.biases[0, head], rows.bits,
                        rows.group_size, rows.rotation)  # center: applied to the stacked output
    return rows[0, head]


def _matmul(x: mx.array, rows: Rows, transpose: bool) -> mx.array:
    """`x @ rows^T` (transpose) or `x @ rows`, rows as codes or floats."""
    if isinstance(rows, _CODES):
        return mx.quantized_matmul(x, rows.packed, rows.scales, rows.biases, transpose=transpose,
                                   group_size=rows.group_size, bits=rows.bits)
    rows = rows.astype(x.dtype) if rows.dtype != x.dtype else rows
    return x @ (rows.swapaxes(-1, -2) if transpose else rows)
