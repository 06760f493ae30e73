"""The statistics an expected-attention policy scores keys with: per layer and query head, the mean and covariance
of the prompt's queries before RoPE, and from them the attention a future query is expected to pay each key.

Expected Attention (as in NVIDIA's kvpress): a future query is modelled as q ~ N(mu, Sigma), estimated from the
queries seen so far (without RoPE, so positions do not blur the estimate; the first `skip` positions, attention
sinks with outlier queries, are left out). A query at a future position p is R(p) q, so the estimate is moved
to the next `future` positions by the average rotation R = mean_t R(L + t). For a cached (post-RoPE) key k,
E[exp(q.k / sqrt(d))] = exp(mu'.k / sqrt(d) + k' Sigma' k / (2 d)); the softmax of that over the keys, averaged over
the query heads of a KV head's group and scaled by the value's norm, is the key's score.

The queries reach us post-RoPE (through the SDPA hook); they are rotated back with the model's own RoPE module
(`rerotate.find_rope`: pure rotations only), one call per pass: reversing the rows turns the module's increasing
positions into each row's own negative position.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np


class QueryStatistics:
    def __init__(self, num_layers: int, rope: Any, skip: int = 4) -> None:
        self.rope = rope
        self.skip = skip
        self.count = [0] * num_layers
        self.sums: list[mx.array | None] = [None] * num_layers  # [Hq, D]
        self.outer: list[mx.array | None] = [None] * num_layers  # [Hq, D, D]
        self._rotation: tuple[tuple[int, int, int], mx.array] | None = None  # every layer of a pass shares it

    def add(self, layer: int, queries: mx.array, end: int) -> None:
        """Queries `[Hq, n, D]` (post-RoPE) at logical positions [end - n, end)."""
        n = queries.shape[1]
        first = max(0, self.skip - (end - n))
        if first >= n:
            return
        rows = queries[:, first:].astype(mx.float32)
        # Row i sits at position end - len + i; reversed, the module's offset + j gives it -(that position).
        pre = self.rope(rows[None, :, ::-1, :], offset=-(end - 1))[0, :, ::-1, :]
        total, outer = pre.sum(axis=1), pre.swapaxes(1, 2) @ pre
        self.count[layer] += n - first
        self.sums[layer] = total if self.sums[layer] is None else self.sums[layer] + total
        self.outer[layer] = outer if self.outer[layer] is None else self.outer[layer] + outer

    def arrays(self) -> list[mx.array]:
        return [a for a in (*self.sums, *self.outer) if a is not None]

    def average_rotation(self, start: int, future: int, dim: int) -> mx.array:
        """mean over t in [0, future) of R(start + t), as a `[D, D]` matrix."""
        key = (int(start), int(future), int(dim))
        if self._rotation is not None and self._rotation[0] == key:
            return self._rotation[1]
        basis = mx.broadcast_to(mx.eye(dim, dtype=mx.float32)[:, None, :], (dim, future, dim))
        rotated = self.rope(basis[None], offset=int(start))[0]  # [D, future, D]: R(start + t) e_j
        matrix = rotated.mean(axis=1).T
        self._rotation = (key, matrix)
        return matrix

    def scores(self, layer: int, keys: mx.array, values: mx.array, logical_end: int, future: int) -> np.ndarray:
        """Expected attention `[H, n]` of the cached keys `[H, n, D]` (values for their norms)."""
        heads, n, dim = keys.shape
        if not self.count[layer]:
            return np.ones((heads, n))  # nothing observed yet: no preference
        q_heads = self.sums[layer].shape[0]
        mu = self.sums[layer] / self.count[layer]
        cov = self.outer[layer] / self.count[layer] - mu[:, :, None] * mu[:, None, :]
        rotation = self.average_rotation(logical_end, future, dim)
        mu = mu @ rotation.T
        cov = rotation @ cov @ rotation.T
        k = mx.repeat(keys.astype(mx.float32), q_heads // heads, axis=0)  # [Hq, n, D]
        logits = (k @ mu[:, :, None])[..., 0] / math.sqrt(dim) + ((k @ cov) * k).sum(axis=-1) / (2 * dim)
        probs = mx.softmax(logits, axis=-1, precise=True).reshape(heads, q_heads // heads, n).mean(axis=1)
        norms = mx.linalg.norm(values.astype(mx.float32), axis=-1)
        out = probs * norms
        mx.eval(out)
        return np.asarray(out, dtype=np.float64)

    def clone(self) -> "QueryStatistics":
        other = QueryStatistics(len(self.count), self.rope, self.skip)
        other.count, other.sums, other.outer = list(self.count), list(self.sums), list(self.outer)
        return other
