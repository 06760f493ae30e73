"""Experiments 2-4, the arena's design checks: head-major layout, one buffer per layer, in-place writes."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import mlx.core as mx
from rich.progress import Progress

from cortexstream.kv.sequence_kv import SequenceKV

from .common import (
    ALL_LAYER_CTX,
    ALL_LAYER_SLOTS,
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    Q_HEADS,
    WRITE_ARENA_BLOCKS,
    extra_peak,
    make_arena,
    sdpa,
    summarise,
)


# --- experiment 2: layout -------------------------------------------------------------------------------------
def experiment_layout(warmup: int, steps: int, progress: Progress) -> list[dict]:
    results: list[dict] = []
    contexts = (2048, 8192)
    task = progress.add_task("2. layout", total=len(contexts) * (warmup + steps))
    for ctx in contexts:
        slots, lo = 2 * ctx, ctx // 2  # the sequence sits inside a larger buffer, not at its start
        head_major = mx.random.normal((KV_HEADS, slots, HEAD_DIM))
        head_major_v = mx.random.normal((KV_HEADS, slots, HEAD_DIM))
        token_major = mx.contiguous(head_major.transpose(1, 0, 2))
        token_major_v = mx.contiguous(head_major_v.transpose(1, 0, 2))
        dense_k = mx.contiguous(head_major[None, :, lo : lo + ctx, :])
        dense_v = mx.contiguous(head_major_v[None, :, lo : lo + ctx, :])
        q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM))
        mx.eval(head_major, head_major_v, token_major, token_major_v, dense_k, dense_v, q)
        fetch: dict[str, Callable[[], tuple[mx.array, mx.array]]] = {
            "head-major view [H,S,D][:, s:e]": lambda: (
                head_major[None, :, lo : lo + ctx, :], head_major_v[None, :, lo : lo + ctx, :]),
            "token-major view [S,H,D][s:e].T": lambda: (
                token_major[lo : lo + ctx].transpose(1, 0, 2)[None],
                token_major_v[lo : lo + ctx].transpose(1, 0, 2)[None]),
            "dense [1,H,L,D] (reference)": lambda: (dense_k, dense_v),
        }
        times: dict[str, list[float]] = {name: [] for name in fetch}
        outs: dict[str, mx.array] = {}
        for i in range(warmup + steps):
            for name, get in fetch.items():
                t0 = time.perf_counter()
                k, v = get()
                out = sdpa(q, k, v)
                mx.eval(out)
                dt = time.perf_counter() - t0
                outs.setdefault(name, out)
                if i >= warmup:
                    times[name].append(dt)
            progress.advance(task)
        base = statistics.median(times["dense [1,H,L,D] (reference)"])
        reference = outs["dense [1,H,L,D] (reference)"]
        for name in fetch:
            row = {"ctx": ctx, "batch": 1, "layout": name, **summarise(times[name])}
            row["ratio_vs_dense"] = row["median_ms"] / (base * 1e3)
            row["max_abs_diff"] = float(mx.max(mx.abs(outs[name] - reference)).item())
            results.append(row)
    return results


# --- experiment 3: one buffer per layer vs one for all layers -------------------------------------------------
class PerLayerBuffers:
    def __init__(self) -> None:
        shape = (KV_HEADS, ALL_LAYER_SLOTS, HEAD_DIM)
        self.k = [mx.zeros(shape) for _ in range(LAYERS)]
        self.v = [mx.zeros(shape) for _ in range(LAYERS)]
        mx.eval(self.k, self.v)

    def write(self, layer: int, pos: int, k: mx.array, v: mx.array) -> None:
        self.k[layer][:, pos : pos + 1, :] = k
        self.v[layer][:, pos : pos + 1, :] = v

    def view(self, layer: int, length: int) -> tuple[mx.array, mx.array]:
        return self.k[layer][None, :, :length, :], self.v[layer][None, :, :length, :]


class AllLayerBuffer:
    def __init__(self) -> None:
        shape = (LAYERS, KV_HEADS, ALL_LAYER_SLOTS, HEAD_DIM)
        self.k = mx.zeros(shape)
        self.v = mx.zeros(shape)
        mx.eval(self.k, self.v)

    def write(self, layer: int, pos: int, k: mx.array, v: mx.array) -> None:
        self.k[layer, :, pos : pos + 1, :] = k
        self.v[layer, :, pos : pos + 1, :] = v

    def view(self, layer: int, length: int) -> tuple[mx.array, mx.array]:
        return self.k[layer, :, :length, :][None], self.v[layer, :, :length, :][None]


def decode_all_layers(store: PerLayerBuffers | AllLayerBuffer, pos: int, q: mx.array, kv: mx.array) -> float:
    """One token through LAYERS attention layers; layer l+1's new K/V is derived from layer l's output."""
    t0 = time.perf_counter()
    x = q
    k_new = kv
    for layer in range(LAYERS):
        store.write(layer, pos, k_new, k_new)
        k, v = store.view(layer, pos + 1)
        x = sdpa(x, k, v)
        k_new = x.reshape(KV_HEADS, Q_HEADS // KV_HEADS, 1, HEAD_DIM).mean(axis=1)  # stand-in for k_proj
    mx.eval(x)
    return time.perf_counter() - t0


def experiment_buffer_per_layer(warmup: int, steps: int, progress: Progress) -> dict:
    task = progress.add_task("3. buffer per layer", total=2 * (warmup + steps))
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM))
    kv = mx.random.normal((KV_HEADS, 1, HEAD_DIM))
    mx.eval(q, kv)
    out: dict[str, Any] = {
        "layers": LAYERS, "kv_heads": KV_HEADS, "slots": ALL_LAYER_SLOTS, "head_dim": HEAD_DIM, "ctx": ALL_LAYER_CTX,
        "mb_per_all_layer_k_buffer": LAYERS * KV_HEADS * ALL_LAYER_SLOTS * HEAD_DIM * 4 / 1e6,
    }
    for name, cls in (("one buffer per layer", PerLayerBuffers), ("one [L,H,S,D] buffer", AllLayerBuffer)):
        store = cls()
        times, peaks = [], []
        for i in range(warmup + steps):
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            dt = decode_all_layers(store, ALL_LAYER_CTX + i, q, kv)
            if i >= warmup:
                times.append(dt)
                peaks.append(extra_peak(base))
            progress.advance(task)
        out[name] = {**summarise(times), "extra_peak_mb": max(peaks) / 1e6}
        del store
    return out


# --- experiment 4: the write is in place ----------------------------------------------------------------------
def experiment_write_in_place(warmup: int, steps: int, progress: Progress) -> list[dict]:
    task = progress.add_task("4. write in place", total=len(WRITE_ARENA_BLOCKS) * (warmup + steps))
    k = mx.random.normal((KV_HEADS, 1, HEAD_DIM))
    mx.eval(k)
    results = []
    for blocks in WRITE_ARENA_BLOCKS:
        arena = make_arena(blocks)
        seq = SequenceKV(arena, contiguous=True)
        seq.ensure_capacity(1024)
        times, peaks = [], []
        for i in range(warmup + steps):
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            t0 = time.perf_counter()
            arena.write(0, seq.blocks, 512 + i, k, k)
            mx.eval(arena.arrays())
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
                peaks.append(extra_peak(base))
            progress.advance(task)
        results.append({
            "arena_blocks": blocks,
            "mb_per_buffer": blocks * BLOCK * KV_HEADS * HEAD_DIM * 4 / 1e6,
            **summarise(times),
            "extra_peak_mb": max(peaks) / 1e6,
        })
        del arena, seq
    return results

