"""Trajectory collection: windows of real K/V with the future post-RoPE queries that attend to them.

How queries are captured. Model code only talks to its cache, and the queries never reach the cache. We reuse the
SDPA hook of `cortexstream.engine.attention_hook`: `backend.sdpa.route_sdpa(model)` routes mlx-lm's
`scaled_dot_product_attention` through `dispatch_sdpa`, which hands the call to `cache.attention_hook` when the
cache has one. `_CaptureCache` (an mlx-lm `KVCache`) has one: it computes the output with the original SDPA
(bit-identical forward pass) and sees exactly what attention sees, for any architecture mlx-lm supports: post-RoPE
(and post q/k-norm) queries [1, Hq, T, D], the cache's keys/values [1, H, T, D], the scale, the mask and learned
sink logits. Nothing is recomputed from layer inputs, so no model-specific projection or RoPE code is needed.

What is stored (one row = one window x KV head x layer). A sequence of T tokens is prefilled once. Windows are
the ones a policy would compress: [s, s + N) for s = num_sinks + i * N with s + N < T. For each row, F future
queries are drawn uniformly without replacement from the (position t >= s + N, query head in the KV head's GQA
group) pairs whose mask shows them the whole window (a sliding-window layer hides old windows; the loss compares
against attention over the full window, so only queries that saw all of it are valid; no such query: no row).
For each query the rest of its real context (all keys it attends except the window, plus sink logits) is
summarised exactly at that query as a first-order pseudo-key (see `loss`): rest_keys = softmax-mean key,
rest_values = softmax-mean value, rest_bias = L_R - scale * q.rest_key. window_share is the window's true
attention share for that query (diagnostic). Rows are float32 in memory and `dtype` on disk.

Bounded memory: rows are computed inside the hook one layer at a time (the layer's tensors are evaluated there
and then released) and buffered until `rows_per_chunk`; each chunk file (`chunk_00000.safetensors`) holds at most
that many rows and the buffer never holds more than rows_per_chunk plus one layer's rows. `index.json` (rewritten
after every chunk, so a partial collection is usable) holds the chunk list and the metadata (scale, shapes).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from cortexstream.models.safetensors_check import check_safetensors

FORMAT = "cortexstream-sidecar-trajectories/1"
FLOAT_FIELDS = ("window_keys", "window_values", "queries", "rest_keys", "rest_values")
ROW_FIELDS = FLOAT_FIELDS + ("rest_bias", "window_share", "group", "layer", "head", "start", "sequence",
                             "query_pos", "query_head")
_DTYPES = {"float16": np.float16, "float32": np.float32}


@dataclass(frozen=True)
class CollectConfig:
    """window N; num_sinks kept tokens before the first window; F = queries_per_window; layers: None = all."""

    window: int = 16
    num_sinks: int = 4
    queries_per_window: int = 8
    rows_per_chunk: int = 4096
    dtype: str = "float16"
    seed: int = 0
    layers: tuple[int, ...] | None = None
    max_rows: int | None = None


def pack_tokens(tokenizer: Any, texts: Iterable[str], sequence_length: int) -> Iterator[list[int]]:
    """Tokenise texts, join them (EOS between) and cut the stream into sequences of exactly `sequence_length`."""
    eos = getattr(tokenizer, "eos_token_id", None)
    buffer: list[int] = []
    for text in texts:
        buffer.extend(tokenizer.encode(text))
        if eos is not None:
            buffer.append(int(eos))
        while len(buffer) >= sequence_length:
            yield buffer[:sequence_length]
            buffer = buffer[sequence_length:]


def _allowed(mask: Any, num_queries: int, num_keys: int) -> np.ndarray | None:
    """[Hq|1, T, K] boolean visibility from mlx-lm's mask argument (None: everything visible). An additive float
    mask counts as hiding where it is -inf or float32's most negative value (as mlx-lm writes it)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"trajectories: unsupported mask {mask!r}")
        rows = np.arange(num_queries)[:, None] + (num_keys - num_queries)
        return (rows >= np.arange(num_keys)[None, :])[None]
    m = np.array(mask.astype(mx.float32) if mask.dtype != mx.bool_ else mask)
    m = m.reshape(m.shape[-3] if m.ndim >= 3 else 1, num_queries, num_keys)
    return m if m.dtype == np.bool_ else m > np.finfo(np.float32).min / 2


def layer_rows(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, sinks: mx.array | None,
               layer: int, config: CollectConfig, rng: np.random.Generator,
               sequence: int = 0) -> dict[str, np.ndarray]:
    """All rows of one layer of one prefilled sequence (see module docstring); float fields float32."""
    q = np.array(queries[0].astype(mx.float32))  # [Hq, T, D]
    k, v = np.array(keys[0].astype(mx.float32)), np.array(values[0].astype(mx.float32))  # [H, T, D]
    hq, t_len, _ = q.shape
    heads, group, n, f = k.shape[0], hq // k.shape[0], config.window, config.queries_per_window
    if k.shape[1] != t_len:
        raise ValueError("trajectories: collect from one prefill of the whole sequence (queries != keys)")
    allowed = _allowed(mask, t_len, t_len)
    sink_logits = None if sinks is None else np.array(sinks.astype(mx.float32))
    starts = list(range(config.num_sinks, t_len - n, n))
    out: dict[str, list[np.ndarray]] = {name: [] for name in ROW_FIELDS}
    for head in range(heads):
        for s in starts:
            pos_c = np.repeat(np.arange(s + n, t_len), group)  # candidate (position, query head) pairs
            qh_c = head * group + np.tile(np.arange(group), t_len - s - n)
            if allowed is not None:  # only queries that see the whole window (a sliding mask may hide it)
                # slice the window's columns before the fancy index: [candidates, n], not [candidates, T]
                sees = allowed[:, :, s:s + n][qh_c % allowed.shape[0], pos_c].all(axis=1)
                pos_c, qh_c = pos_c[sees], qh_c[sees]
            if len(pos_c) == 0:
                continue
            pick = rng.choice(len(pos_c), size=f, replace=len(pos_c) < f)
            pos, qh = pos_c[pick], qh_c[pick]
            qv = q[qh, pos]  # [F, D]
            logits = scale * (qv @ k[head].T).astype(np.float64)  # [F, T]
            visible = np.ones_like(logits, bool) if allowed is None else allowed[qh % allowed.shape[0], pos]
            in_window = np.zeros(t_len, bool)
            in_window[s:s + n] = True
            rest = visible & ~in_window[None]
            top = np.max(np.where(rest, logits, -np.inf), axis=1, keepdims=True)
            e = np.where(rest, np.exp(logits - top), 0.0)
            z = e.sum(axis=1)
            if sink_logits is not None:  # learned sinks: mass in the normaliser, no key or value
                z = z + np.exp(sink_logits[qh] - top[:, 0])
            rest_k, rest_v = (e @ k[head]) / z[:, None], (e @ v[head]) / z[:, None]
            log_z = top[:, 0] + np.log(z)
            win = logits[:, s:s + n]
            wtop = win.max(axis=1)
            log_w = wtop + np.log(np.exp(win - wtop[:, None]).sum(axis=1))
            fields = {
                "window_keys": k[head, s:s + n], "window_values": v[head, s:s + n], "queries": qv,
                "rest_keys": rest_k, "rest_values": rest_v,
                "rest_bias": log_z - scale * np.sum(qv * rest_k, axis=1),
                "window_share": 1.0 / (1.0 + np.exp(log_z - log_w)),
                "group": np.int32(layer * heads + head), "layer": np.int32(layer), "head": np.int32(head),
                "start": np.int32(s), "sequence": np.int32(sequence), "query_pos": pos, "query_head": qh,
            }
            for name, value in fields.items():
                out[name].append(np.asarray(value))
    if not out["group"]:
        return {}
    return {name: np.stack(vals).astype(np.float32 if name in FLOAT_FIELDS + ("rest_bias", "window_share")
                                        else np.int32) for name, vals in out.items()}


class TrajectoryWriter:
    """Buffers rows and writes chunk files of at most `rows_per_chunk` rows, plus `index.json`."""

    def __init__(self, directory: str, config: CollectConfig, metadata: dict[str, Any]):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.config = directory, config
        self.meta = {"format": FORMAT, "collect": {**asdict(config), "layers": config.layers}, **metadata}
        self.chunks: list[dict[str, Any]] = []
        self.buffer: dict[str, list[np.ndarray]] = {name: [] for name in ROW_FIELDS}
        self.buffered = self.peak_rows = self.rows = 0

    @property
    def full(self) -> bool:
        return self.config.max_rows is not None and self.rows + self.buffered >= self.config.max_rows

    def add(self, rows: dict[str, np.ndarray]) -> None:
        if not rows or self.full:
            return
        if self.config.max_rows is not None:
            keep = self.config.max_rows - self.rows - self.buffered
            rows = {name: a[:keep] for name, a in rows.items()}
        for name in ROW_FIELDS:
            self.buffer[name].append(rows[name])
        self.buffered += len(rows["group"])
        self.peak_rows = max(self.peak_rows, self.buffered)
        while self.buffered >= self.config.rows_per_chunk:
            self._flush(self.config.rows_per_chunk)

    def _flush(self, count: int) -> None:
        joined = {name: np.concatenate(parts) for name, parts in self.buffer.items()}
        disk = _DTYPES[self.config.dtype]
        arrays = {name: mx.array(a[:count].astype(disk) if name in FLOAT_FIELDS else a[:count])
                  for name, a in joined.items()}
        name = f"chunk_{len(self.chunks):05d}.safetensors"
        mx.save_safetensors(os.path.join(self.directory, name), arrays)
        self.chunks.append({"file": name, "rows": count})
        self.buffer = {key: [a[count:]] for key, a in joined.items()}
        self.buffered -= count
        self.rows += count
        self._write_index()

    def close(self, **extra: Any) -> dict[str, Any]:
        if self.buffered:
            self._flush(self.buffered)
        self.meta.update(extra, peak_buffered_rows=self.peak_rows)
        return self._write_index()

    def _write_index(self) -> dict[str, Any]:
        index = {**self.meta, "rows": self.rows, "chunks": self.chunks}
        tmp = os.path.join(self.directory, "index.json.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(index, fh, indent=1)
        os.replace(tmp, os.path.join(self.directory, "index.json"))
        return index


def collect_trajectories(model: Any, sequences: Iterable[Sequence[int]], directory: str,
                         config: CollectConfig = CollectConfig(), *, progress: bool = True,
                         total: int | None = None) -> dict[str, Any]:
    """Prefill each token sequence once through the frozen model and write its rows; returns the index dict.

    Stops after `config.max_rows` rows (the last sequence's extra rows are dropped). `total`: number of
    sequences, for the progress bar only.
    """
    from mlx_lm.models.cache import KVCache
    from tqdm import tqdm

    from cortexstream.backend.sdpa import original_sdpa, route_sdpa

    route_sdpa(model)
    num_layers = len(model.layers)
    layers = set(range(num_layers) if config.layers is None else config.layers)
    state: dict[str, Any] = {"sequence": 0, "writer": None}

    class _CaptureCache(KVCache):
        def __init__(self, layer: int):
            super().__init__()
            self.layer = layer

        def attention_hook(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                           sinks: mx.array | None = None) -> mx.array:
            out = original_sdpa(queries, keys, values, self, scale=scale, mask=mask, sinks=sinks)
            if state["writer"] is None:
                state["writer"] = TrajectoryWriter(directory, config, {
                    "num_layers": num_layers, "num_kv_heads": keys.shape[1], "num_query_heads": queries.shape[1],
                    "head_dim": keys.shape[-1], "value_dim": values.shape[-1], "scale": float(scale)})
            if self.layer in layers:
                mx.eval(queries, keys, values)
                rng = np.random.default_rng([config.seed, state["sequence"], self.layer])
                state["writer"].add(layer_rows(queries, keys, values, scale, mask, sinks, self.layer, config, rng,
                                               sequence=state["sequence"]))
            return out

    tokens = 0
    bar = tqdm(sequences, total=total, desc="trajectories", unit="seq", disable=not progress)
    for index, seq in enumerate(bar):
        state["sequence"] = index
        mx.eval(model(mx.array([list(seq)]), cache=[_CaptureCache(i) for i in range(num_layers)]))
        tokens += len(seq)
        writer = state["writer"]
        bar.set_postfix(rows=writer.rows + writer.buffered)
        if writer.full:
            break
    bar.close()
    if state["writer"] is None:
        raise ValueError("collect_trajectories: no sequences")
    return state["writer"].close(sequences=state["sequence"] + 1, tokens=tokens)


class TrajectoryStore:
    """Read side of a collection: `index.json` metadata and one chunk at a time (float fields as float32)."""

    def __init__(self, directory: str):
        path = os.path.join(directory, "index.json")
        try:
            with open(path, encoding="utf-8") as fh:
                self.meta: dict[str, Any] = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{directory}: not a trajectory collection ({exc})") from exc
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.directory = directory
        self.chunk_rows: list[int] = [int(c["rows"]) for c in self.meta["chunks"]]

    @property
    def num_rows(self) -> int:
        return sum(self.chunk_rows)

    @property
    def scale(self) -> float:
        return float(self.meta["scale"])

    def load_chunk(self, index: int) -> dict[str, mx.array]:
        path = os.path.join(self.directory, self.meta["chunks"][index]["file"])
        check_safetensors(path)  # a damaged chunk is named, not a terse MLX error
        arrays = mx.load(path)
        return {name: a.astype(mx.float32) if name in FLOAT_FIELDS else a for name, a in arrays.items()}

    def load_all(self) -> dict[str, mx.array]:
        """Every row in memory (small collections and tests only)."""
        parts = [self.load_chunk(i) for i in range(len(self.chunk_rows))]
        return {name: mx.concatenate([p[name] for p in parts]) for name in ROW_FIELDS}
