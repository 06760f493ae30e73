"""KV-arena attention benchmark: one decode step of one attention layer, arena vs mlx-lm's KVCache.

Run: ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_arena_attention.py``
(about 45 s on 2 shared cores; ``--quick``: fewer steps, about 25 s). Writes bench/results/arena_attention.json and
bench/results/arena_attention.md.

Shapes are SmolLM2-like: 9 query heads, 3 KV heads, head_dim 64, float32, block size 16. A *step* is what one layer
does per generated token: write the new token's K/V into the cache, fetch the K/V to attend over, run
``mx.fast.scaled_dot_product_attention`` and ``mx.eval`` the output. It is timed with ``perf_counter`` around graph
construction + eval (Python overhead included); the median over 30 steps (90 at batch 1, where steps are cheap)
after 5 untimed ones is reported (``--quick``: 10 / 30 after 2).
All variants of one (context, batch) point run interleaved, one step each in turn, so that load from neighbours on
this shared machine hits them alike. Every variant starts from the same random prefill and the same new token, and
its first output is checked against mlx-lm's (max |diff| is in the JSON).

Experiments:
1. ``attention``: context 512 / 2048 / 8192, batch 1 and 8 (all sequences of the same length):
   * mlx-lm ``KVCache`` (batch B: one cache holding [B, H, L, D]), the baseline; at batch 8 also with the same
     boolean padding mask DecodeBatch uses (a reference that separates the mask's cost from the gather's);
   * arena contiguous: batch 1 through ``ArenaKVCache`` (zero-copy view); batch 8 through ``DecodeBatch`` (one
     scatter, then a block gather into a padded [B, H, L, D]) and as per-sequence views (all writes first, then 8
     SDPA calls on views, outputs concatenated);
   * arena paged: block tables deliberately non-contiguous (batch 1: a random permutation of the sequence's blocks;
     batch 8: the sequences' blocks interleaved round-robin), through ``ArenaKVCache`` (block gather) and
     ``DecodeBatch``.
   The arena of each variant holds all its sequences (context + the steps run) plus 25 % spare blocks. mlx-lm's
   cache regrows by concatenation every 256 tokens; that happens during warm-up here, so its numbers are its steady
   state (favourable to the baseline). ``DecodeBatch()`` construction + ``commit()`` happen once per forward pass
   for all layers; they are timed apart (``setup_us``) and not in the step.
   Experiment 1 runs twice: with MLX's default CPU buffer-cache limit (32 MiB, what the engine uses today) and with
   ``mx.set_cache_limit(1 GiB)``. A freed buffer that does not fit in the cache goes back to the OS, and the next
   allocation of that size page-faults fresh memory; the minor page faults per step are recorded.
2. ``layout``: SDPA alone on a head-major view ``buf[:, s:e, :]`` ([H, S, D], the arena's layout) vs a token-major
   view ``buf[s:e].transpose(1, 0, 2)`` ([S, H, D]) vs a dense [1, H, L, D] array, batch 1, context 2048 and 8192.
3. ``buffer_per_layer``: a 30-layer decode step (write, view, SDPA per layer; each layer's new K/V computed from the
   previous layer's attention output, as in a model) over one buffer per layer vs one [L, H, S, D] buffer for all
   layers, 3 KV heads x 4096 slots x 64 x float32 (94 MB per all-layer K buffer), context 2048: time and peak memory.
4. ``write_in_place``: ``KVArena.write`` of one token + eval at arena sizes from 13 MB to 805 MB per buffer: a
   constant time says the update is in place (no copy of the buffer).
5. ``per_sequence_pitfall``: batch 8, context 2048: 8 ``ArenaKVCache.update_and_fetch`` calls (write, view, write,
   view, ...) in one graph vs all writes first, then the views.
6. ``python_overhead``: graph-construction time (no eval) of one ``update_and_fetch``, arena vs mlx-lm, per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_lm.models.cache import KVCache  # noqa: E402

from cortexstream.engine.batch_cache import DecodeBatch  # noqa: E402
from cortexstream.kv.arena import KVArena  # noqa: E402
from cortexstream.kv.arena_cache import ArenaKVCache  # noqa: E402
from cortexstream.kv.arena_config import ArenaConfig  # noqa: E402
from cortexstream.kv.sequence_kv import SequenceKV  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
CONTEXTS = (512, 2048, 8192)
BATCHES = (1, 8)
B1_STEPS_FACTOR = 3  # batch-1 steps are cheap: 3x the steps for a tighter median on the 5 % question
SPARE = 0.25  # spare arena blocks beyond what the sequences need
SEED = 1234
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
TARGET = 1.05  # contiguous must be within 5 % of mlx-lm

BIG_CACHE = 1 << 30  # experiment 1 is run again with this MLX buffer-cache limit
# experiment 3
LAYERS, ALL_LAYER_SLOTS, ALL_LAYER_CTX = 30, 4096, 2048
# experiment 4
WRITE_ARENA_BLOCKS = (1024, 8192, 65536)

LABELS = {
    "mlx_lm": "mlx-lm KVCache (baseline)",
    "mlx_lm_mask": "mlx-lm KVCache + padding mask (ref.)",
    "contig_view": "arena contiguous: ArenaKVCache view",
    "contig_decodebatch": "arena contiguous: DecodeBatch gather",
    "contig_views": "arena contiguous: per-sequence views",
    "paged_gather": "arena paged (shuffled): ArenaKVCache gather",
    "paged_decodebatch": "arena paged (interleaved): DecodeBatch gather",
}


def minor_faults() -> int:
    """Minor page faults of this process so far: fresh pages the OS had to map (memory not reused)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def extra_peak(base: int) -> int:
    """Peak MLX memory since `mx.reset_peak_memory()` above `base` (the peak restarts at 0, not at what is live)."""
    return max(mx.get_peak_memory(), base) - base


def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None = None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)


# --- variants of experiment 1 -----------------------------------------------------------------------------------
@dataclass
class Inputs:
    """Prefill K/V [B, KV, ctx, D], the new token's K/V [B, KV, 1, D] and the query [B, Q, 1, D]."""

    ctx: int
    batch: int
    prefill_k: mx.array
    prefill_v: mx.array
    k_new: mx.array
    v_new: mx.array
    q: mx.array


class Variant:
    """One way to run a layer's decode step. `step` returns (seconds of the timed region, output)."""

    key = ""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.setup: list[float] = []
        self.faults: list[int] = []
        self.first_out: mx.array | None = None

    def step(self) -> tuple[float, mx.array]:
        raise NotImplementedError

    def run_step(self, timed: bool) -> None:
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        faults = minor_faults()
        dt, out = self.step()
        faults = minor_faults() - faults
        peak = extra_peak(base)
        if self.first_out is None:
            self.first_out = out
        if timed:
            self.times.append(dt)
            self.peaks.append(peak)
            self.faults.append(faults)


class MlxLm(Variant):
    key = "mlx_lm"

    def __init__(self, inp: Inputs, with_mask: bool = False) -> None:
        super().__init__()
        self.inp = inp
        self.with_mask = with_mask
        self.key = "mlx_lm_mask" if with_mask else "mlx_lm"
        self.cache = KVCache()
        self.cache.update_and_fetch(inp.prefill_k, inp.prefill_v)
        mx.eval(self.cache.keys, self.cache.values)

    def step(self) -> tuple[float, mx.array]:
        inp = self.inp
        t0 = time.perf_counter()
        k, v = self.cache.update_and_fetch(inp.k_new, inp.v_new)
        mask = None
        if self.with_mask:  # what a batch of unequal lengths needs; all True here
            lengths = mx.full((inp.batch,), self.cache.offset, dtype=mx.int32)
            mask = (mx.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
        out = sdpa(inp.q, k, v, mask)
        mx.eval(out)
        return time.perf_counter() - t0, out


def make_arena(num_blocks: int) -> KVArena:
    return KVArena(ArenaConfig(1, KV_HEADS, HEAD_DIM, num_blocks, BLOCK, "float32"))


def arena_blocks(batch: int, tokens_per_seq: int) -> tuple[int, int]:
    """(blocks per sequence, arena blocks with SPARE headroom)."""
    per_seq = -(-tokens_per_seq // BLOCK)
    return per_seq, int(np.ceil(batch * per_seq * (1 + SPARE)))


def make_sequences(
    inp: Inputs, capacity: int, layout: str, rng: np.random.Generator
) -> tuple[KVArena, list[SequenceKV]]:
    """An arena holding `inp.batch` sequences prefilled with `inp.prefill_*`.

    layout: "contiguous" (each sequence one run of blocks), "shuffled" (each sequence's blocks in random order),
    "interleaved" (sequence i owns blocks i, i+B, i+2B, ...).
    """
    per_seq, total = arena_blocks(inp.batch, capacity)
    arena = make_arena(total)
    seqs: list[SequenceKV] = []
    if layout == "contiguous":
        for i in range(inp.batch):
            seq = SequenceKV(arena, owner=i, contiguous=True)
            seq.ensure_capacity(capacity)
            seqs.append(seq)
    else:
        blocks = arena.allocator.allocate(inp.batch * per_seq, owner=0)
        for i in range(inp.batch):
            table = blocks[i * per_seq : (i + 1) * per_seq] if layout == "shuffled" else blocks[i :: inp.batch]
            if layout == "shuffled":
                table = [int(b) for b in rng.permutation(table)]
            seqs.append(SequenceKV(arena, owner=0, contiguous=False, blocks=list(table)))
    for i, seq in enumerate(seqs):
        if layout != "contiguous":
            assert KVArena.contiguous_start(seq.blocks) is None, "paged table must not be contiguous"
        arena.write(0, seq.blocks, 0, inp.prefill_k[i], inp.prefill_v[i])
        seq.lengths[0] = seq.offsets[0] = inp.ctx
    mx.eval(arena.keys, arena.values)
    return arena, seqs


class ArenaSingle(Variant):
    """Batch 1 through `ArenaKVCache.update_and_fetch` (view if contiguous, block gather if paged)."""

    def __init__(self, key: str, inp: Inputs, seq: SequenceKV) -> None:
        super().__init__()
        self.key = key
        self.inp = inp
        self.cache = ArenaKVCache(seq, 0)

    def step(self) -> tuple[float, mx.array]:
        inp = self.inp
        t0 = time.perf_counter()
        k, v = self.cache.update_and_fetch(inp.k_new, inp.v_new)
        out = sdpa(inp.q, k, v)
        mx.eval(out)
        return time.perf_counter() - t0, out


class ArenaDecodeBatch(Variant):
    """Batch B through `DecodeBatch`: scatter the new tokens, gather blocks into a padded [B, H, L, D] + mask."""

    def __init__(self, key: str, inp: Inputs, arena: KVArena, seqs: list[SequenceKV]) -> None:
        super().__init__()
        self.key = key
        self.inp = inp
        self.arena = arena
        self.seqs = seqs

    def step(self) -> tuple[float, mx.array]:
        inp = self.inp
        t_setup = time.perf_counter()
        batch = DecodeBatch(self.arena, self.seqs)
        cache = batch.caches()[0]
        t0 = time.perf_counter()
        k, v = cache.update_and_fetch(inp.k_new, inp.v_new)
        out = sdpa(inp.q, k, v, cache.make_mask(1))
        mx.eval(out)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        batch.commit()
        self.setup.append((t0 - t_setup) + (time.perf_counter() - t1))
        return dt, out


class ArenaPerSequenceViews(Variant):
    """Batch B as B zero-copy views: every sequence's write first, then one SDPA per view, outputs concatenated.

    (Interleaving write/view per sequence in one graph makes each write copy the buffer: see experiment 5.)
    """

    def __init__(self, key: str, inp: Inputs, arena: KVArena, seqs: list[SequenceKV]) -> None:
        super().__init__()
        self.key = key
        self.inp = inp
        self.arena = arena
        self.seqs = seqs
        self.q = [inp.q[i : i + 1] for i in range(inp.batch)]
        self.k_new = [inp.k_new[i] for i in range(inp.batch)]
        self.v_new = [inp.v_new[i] for i in range(inp.batch)]
        mx.eval(self.q, self.k_new, self.v_new)

    def step(self) -> tuple[float, mx.array]:
        arena = self.arena
        t0 = time.perf_counter()
        for i, seq in enumerate(self.seqs):
            arena.write(0, seq.blocks, seq.lengths[0], self.k_new[i], self.v_new[i])
            seq.lengths[0] += 1
            seq.offsets[0] += 1
        outs = []
        for i, seq in enumerate(self.seqs):
            k, v = arena.read(0, seq.blocks, seq.lengths[0])
            outs.append(sdpa(self.q[i], k[None], v[None]))
        out = mx.concatenate(outs, axis=0)
        mx.eval(out)
        return time.perf_counter() - t0, out


def make_inputs(ctx: int, batch: int) -> Inputs:
    shape = (batch, KV_HEADS, ctx, HEAD_DIM)
    arrays = [
        mx.random.normal(shape),
        mx.random.normal(shape),
        mx.random.normal((batch, KV_HEADS, 1, HEAD_DIM)),
        mx.random.normal((batch, KV_HEADS, 1, HEAD_DIM)),
        mx.random.normal((batch, Q_HEADS, 1, HEAD_DIM)),
    ]
    mx.eval(arrays)
    return Inputs(ctx, batch, *arrays)


def summarise(times: list[float]) -> dict[str, Any]:
    ms = [t * 1e3 for t in times]
    q = np.percentile(ms, [25, 75]) if ms else [float("nan")] * 2
    return {
        "median_ms": statistics.median(ms),
        "p25_ms": float(q[0]),
        "p75_ms": float(q[1]),
        "min_ms": min(ms),
        "steps": len(ms),
        "times_ms": [round(t, 4) for t in ms],
    }


def interleave(variants: list[Any], warmup: int, steps: int, advance: Callable[[], None]) -> None:
    for i in range(warmup + steps):
        for variant in variants:
            variant.run_step(timed=i >= warmup)
        advance()


def experiment_attention(
    warmup: int, steps: int, progress: Progress, rng: np.random.Generator, cache_limit: int | None
) -> list[dict]:
    """cache_limit: MLX buffer-cache limit in bytes for this run (None: MLX's default)."""
    results: list[dict] = []
    points = [(c, b) for c in CONTEXTS for b in BATCHES]
    tag = "default cache" if cache_limit is None else f"cache {cache_limit >> 20} MiB"

    def n_steps(batch: int) -> int:
        return B1_STEPS_FACTOR * steps if batch == 1 else steps

    task = progress.add_task(f"1. attention, {tag}", total=sum(warmup + n_steps(b) for _, b in points))
    mx.clear_cache()
    previous = mx.set_cache_limit(cache_limit) if cache_limit is not None else None
    for ctx, batch in points:
        progress.update(task, description=f"1. attention ctx={ctx} B={batch}, {tag}")
        capacity = warmup + n_steps(batch) + 2  # tokens appended per sequence (+1 spare)
        inp = make_inputs(ctx, batch)
        variants: list[Variant] = [MlxLm(inp)]
        if batch == 1:
            _, (seq,) = make_sequences(inp, ctx + capacity, "contiguous", rng)
            variants.append(ArenaSingle("contig_view", inp, seq))
            _, (pseq,) = make_sequences(inp, ctx + capacity, "shuffled", rng)
            variants.append(ArenaSingle("paged_gather", inp, pseq))
        else:
            variants.append(MlxLm(inp, with_mask=True))
            arena, seqs = make_sequences(inp, ctx + capacity, "contiguous", rng)
            variants.append(ArenaDecodeBatch("contig_decodebatch", inp, arena, seqs))
            arena, seqs = make_sequences(inp, ctx + capacity, "contiguous", rng)
            variants.append(ArenaPerSequenceViews("contig_views", inp, arena, seqs))
            arena, seqs = make_sequences(inp, ctx + capacity, "interleaved", rng)
            variants.append(ArenaDecodeBatch("paged_decodebatch", inp, arena, seqs))
        interleave(variants, warmup, n_steps(batch), lambda: progress.advance(task))
        reference = variants[0].first_out
        base = statistics.median(variants[0].times)
        _, total_blocks = arena_blocks(batch, ctx + capacity)
        for variant in variants:
            row = {"ctx": ctx, "batch": batch, "variant": variant.key, "label": LABELS[variant.key],
                   "cache_limit": cache_limit if cache_limit is not None else "default"}
            row.update(summarise(variant.times))
            row["minor_faults_per_step"] = statistics.median(variant.faults)
            row["ratio_vs_mlx_lm"] = row["median_ms"] / (base * 1e3)
            # same-round ratio: both ran back to back, so slow drifts of the neighbours' load cancel out
            row["paired_ratio_vs_mlx_lm"] = statistics.median(
                t / t0 for t, t0 in zip(variant.times, variants[0].times))
            row["extra_peak_mb"] = max(variant.peaks) / 1e6
            row["max_abs_diff_vs_mlx_lm"] = float(mx.max(mx.abs(variant.first_out - reference)).item())
            if variant.setup:
                row["setup_us"] = statistics.median(variant.setup) * 1e6
            if not variant.key.startswith("mlx_lm"):
                row["arena_blocks"] = total_blocks
                row["arena_mb_per_buffer"] = total_blocks * BLOCK * KV_HEADS * HEAD_DIM * 4 / 1e6
            results.append(row)
        del variants, inp
    if previous is not None:
        mx.set_cache_limit(previous)
    mx.clear_cache()
    return results


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
            mx.eval(arena.keys, arena.values)
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


# --- experiment 5: per-sequence update_and_fetch in one graph -------------------------------------------------
def experiment_pitfall(warmup: int, steps: int, progress: Progress, rng: np.random.Generator) -> dict:
    ctx, batch = 2048, 8
    task = progress.add_task("5. per-sequence pitfall", total=warmup + steps)
    inp = make_inputs(ctx, batch)

    class Interleaved(Variant):
        key = "interleaved"

        def __init__(self) -> None:
            super().__init__()
            self.arena, seqs = make_sequences(inp, ctx + warmup + steps + 2, "contiguous", rng)
            self.caches = [ArenaKVCache(s, 0) for s in seqs]

        def step(self) -> tuple[float, mx.array]:
            t0 = time.perf_counter()
            outs = []
            for i, cache in enumerate(self.caches):
                k, v = cache.update_and_fetch(inp.k_new[i : i + 1], inp.v_new[i : i + 1])
                outs.append(sdpa(inp.q[i : i + 1], k, v))
            out = mx.concatenate(outs, axis=0)
            mx.eval(out)
            return time.perf_counter() - t0, out

    interleaved = Interleaved()
    arena, seqs = make_sequences(inp, ctx + warmup + steps + 2, "contiguous", rng)
    writes_first = ArenaPerSequenceViews("contig_views", inp, arena, seqs)
    interleave([interleaved, writes_first], warmup, steps, lambda: progress.advance(task))
    return {
        "ctx": ctx,
        "batch": batch,
        "mb_per_buffer": interleaved.arena.keys[0].nbytes / 1e6,
        "update_and_fetch per sequence, one graph": {
            **summarise(interleaved.times), "extra_peak_mb": max(interleaved.peaks) / 1e6},
        "all writes, then views": {**summarise(writes_first.times), "extra_peak_mb": max(writes_first.peaks) / 1e6},
        "max_abs_diff": float(mx.max(mx.abs(interleaved.first_out - writes_first.first_out)).item()),
    }


# --- experiment 6: Python overhead of update_and_fetch --------------------------------------------------------
def experiment_python_overhead(progress: Progress, rng: np.random.Generator, reps: int) -> list[dict]:
    task = progress.add_task("6. python overhead", total=len(CONTEXTS))
    results = []
    for ctx in CONTEXTS:
        inp = make_inputs(ctx, 1)
        mlx_cache = MlxLm(inp).cache
        _, (seq,) = make_sequences(inp, ctx + reps + 8, "contiguous", rng)
        _, (pseq,) = make_sequences(inp, ctx + reps + 8, "shuffled", rng)
        caches: dict[str, Any] = {
            "mlx_lm": mlx_cache, "contig_view": ArenaKVCache(seq, 0), "paged_gather": ArenaKVCache(pseq, 0)}
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(reps):
            for name, cache in caches.items():
                t0 = time.perf_counter()
                k, v = cache.update_and_fetch(inp.k_new, inp.v_new)
                times[name].append(time.perf_counter() - t0)
                mx.eval(k, v)  # untimed: keep the graph one step deep
                del k, v
        start_us = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                KVArena.contiguous_start(seq.blocks)
            start_us.append((time.perf_counter() - t0) / 200 * 1e6)
        row: dict[str, Any] = {"ctx": ctx, "blocks_in_table": len(seq.blocks)}
        for name in caches:
            row[f"{name}_us"] = statistics.median(times[name]) * 1e6
        row["contiguous_start_us"] = min(start_us)
        results.append(row)
        progress.advance(task)
    return results


# --- report ---------------------------------------------------------------------------------------------------
def openblas_loaded() -> bool:
    """Whether OpenBLAS was LD_PRELOADed (MLX's wheel otherwise uses its bundled reference BLAS; NumPy's own
    OpenBLAS, which is always mapped, does not count)."""
    preload = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "openblas" in p]
    if not preload:
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return True
    return any(os.path.realpath(p) in maps or p in maps for p in preload)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_meta(args: argparse.Namespace, warmup: int, steps: int) -> dict:
    import mlx_lm

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_note": "shared with other workloads",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "numpy": np.__version__,
        "mlx_device": str(mx.default_device()),
        "blas": f"OpenBLAS ({OPENBLAS} via LD_PRELOAD)" if openblas_loaded() else "NOT OpenBLAS-preloaded",
        "shapes": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
                   "block_size": BLOCK},
        "warmup": warmup,
        "steps": steps,
        "quick": args.quick,
        "seed": SEED,
        "spare_blocks_fraction": SPARE,
        "mlx_default_cache_limit": default_cache_limit(),
        "big_cache_limit": BIG_CACHE,
    }


def default_cache_limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


def fmt(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}"


def to_markdown(data: dict) -> str:
    meta = data["meta"]
    att = data["attention"]
    lines = [
        "# KV-arena attention benchmark",
        "",
        f"`python bench/bench_arena_attention.py{' --quick' if meta['quick'] else ''}` on {meta['platform']}, "
        f"{meta['cpu']}, {meta['cores']} cores (shared), MLX {meta['mlx']} ({meta['mlx_device']}), "
        f"mlx-lm {meta['mlx_lm']}, BLAS: {meta['blas']}; {meta['elapsed_s']:.0f} s in all. "
        f"One attention layer, 9 query / 3 KV heads, head_dim 64, float32, block 16. Median of {meta['steps']} "
        f"steps ({B1_STEPS_FACTOR * meta['steps']} at batch 1 in exp. 1) after {meta['warmup']} warm-up, variants "
        "interleaved; the machine is shared, so expect a few % of noise between runs; a step = write the new "
        "token's K/V + fetch K/V + SDPA + `mx.eval`. See the script's docstring for details; all timings are in "
        "arena_attention.json.",
        "",
        "## 1. Decode-step attention, one layer (ms per step; ratio = median / mlx-lm median)",
        "",
        f"Left: MLX's default CPU buffer-cache limit ({meta['mlx_default_cache_limit'] >> 20} MiB, what the engine "
        f"runs with today); right: the same run with `mx.set_cache_limit({meta['big_cache_limit'] >> 20} MiB)`. "
        "Page faults = median minor page faults per step (fresh pages mapped because a freed buffer was not reused). "
        "Extra peak = peak MLX memory during the step above what was live before it (default cache).",
        "",
        "Ratio = median / mlx-lm's median; paired = median over rounds of the same-round ratio (robust to load "
        "drift). Every variant's output matched mlx-lm's to "
        f"{max(r['max_abs_diff_vs_mlx_lm'] for r in att + data['attention_big_cache']):.0e} (max abs diff).",
        "",
        "| ctx | B | variant | median ms | p25-p75 ms | ratio | paired | page faults | median ms, big cache | "
        "ratio, big cache | paired, big cache | extra peak MB |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    big = {(r["ctx"], r["batch"], r["variant"]): r for r in data["attention_big_cache"]}
    for r in att:
        b = big[(r["ctx"], r["batch"], r["variant"])]
        setup = f" (setup {r['setup_us']:.0f} us/step, shared by layers)" if "setup_us" in r else ""
        lines.append(
            f"| {r['ctx']} | {r['batch']} | {r['label']}{setup} | {fmt(r['median_ms'])} | "
            f"{fmt(r['p25_ms'])}-{fmt(r['p75_ms'])} | **{r['ratio_vs_mlx_lm']:.2f}** | "
            f"{r['paired_ratio_vs_mlx_lm']:.2f} | {r['minor_faults_per_step']:.0f} | {fmt(b['median_ms'])} | "
            f"**{b['ratio_vs_mlx_lm']:.2f}** | {b['paired_ratio_vs_mlx_lm']:.2f} | {r['extra_peak_mb']:.1f} |"
        )
    lines += [
        "",
        "## 2. Layout: SDPA alone on a view, batch 1",
        "",
        "| ctx | K/V operand | median ms | ratio vs dense |",
        "|---:|---|---:|---:|",
    ]
    for r in data["layout"]:
        lines.append(f"| {r['ctx']} | {r['layout']} | {fmt(r['median_ms'])} | {r['ratio_vs_dense']:.2f} |")
    b = data["buffer_per_layer"]
    lines += [
        "",
        f"## 3. One buffer per layer vs one for all layers ({b['layers']} layers x {b['kv_heads']} KV heads x "
        f"{b['slots']} slots x {b['head_dim']} x float32 = {b['mb_per_all_layer_k_buffer']:.0f} MB per K, "
        f"same for V; context {b['ctx']}; one decode step through all layers)",
        "",
        "| design | median ms / step | extra peak MB |",
        "|---|---:|---:|",
    ]
    for name in ("one buffer per layer", "one [L,H,S,D] buffer"):
        lines.append(f"| {name} | {fmt(b[name]['median_ms'], 1)} | {b[name]['extra_peak_mb']:.1f} |")
    lines += [
        "",
        "## 4. `KVArena.write` of one token + eval vs arena size (in place?)",
        "",
        "| arena blocks | MB per buffer | median ms | extra peak MB |",
        "|---:|---:|---:|---:|",
    ]
    for r in data["write_in_place"]:
        lines.append(f"| {r['arena_blocks']} | {r['mb_per_buffer']:.0f} | {fmt(r['median_ms'])} | "
                     f"{r['extra_peak_mb']:.2f} |")
    p = data["per_sequence_pitfall"]
    lines += [
        "",
        f"## 5. Batch {p['batch']} as per-sequence views, ctx {p['ctx']} ({p['mb_per_buffer']:.0f} MB per buffer)",
        "",
        "| order in the graph | median ms | extra peak MB |",
        "|---|---:|---:|",
    ]
    for name in ("update_and_fetch per sequence, one graph", "all writes, then views"):
        lines.append(f"| {name} | {fmt(p[name]['median_ms'])} | {p[name]['extra_peak_mb']:.1f} |")
    lines += [
        "",
        "## 6. Python cost of one `update_and_fetch` (graph construction only, us per layer per step)",
        "",
        "| ctx | blocks in table | mlx-lm | arena contiguous | arena paged | of which one `contiguous_start` |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["python_overhead"]:
        lines.append(f"| {r['ctx']} | {r['blocks_in_table']} | {r['mlx_lm_us']:.1f} | {r['contig_view_us']:.1f} | "
                     f"{r['paged_gather_us']:.1f} | {r['contiguous_start_us']:.1f} |")
    lines += ["", "## Conclusions", ""] + [f"- {c}" for c in conclusions(data)]
    return "\n".join(lines) + "\n"


def conclusions(data: dict) -> list[str]:
    """Generated from the numbers, so that a re-run cannot leave stale claims behind."""

    def ratios(key: str, run: str = "attention", kind: str = "ratio_vs_mlx_lm") -> list[tuple[int, float]]:
        return [(r["ctx"], r[kind]) for r in data[run] if r["variant"] == key]

    def span(rs: list[tuple[int, float]]) -> str:
        return "/".join(f"{x:.2f}" for _, x in rs)

    def within(rs: list[tuple[int, float]]) -> str:
        bad = [c for c, x in rs if x > TARGET]
        return "within 5 % at every context" if not bad else f"NOT within 5 % at ctx {', '.join(map(str, bad))}"

    ctxs = "/".join(str(c) for c in CONTEXTS)
    out = []
    view = ratios("contig_view")
    po = {r["ctx"]: r for r in data["python_overhead"]}
    extra = "/".join(f"{po[c]['contig_view_us'] - po[c]['mlx_lm_us']:.0f}" for c in CONTEXTS)
    starts = "/".join(f"{2 * po[c]['contiguous_start_us']:.0f}" for c in CONTEXTS)
    med = {(r["ctx"], r["variant"]): r["median_ms"] for r in data["attention"] if r["batch"] == 1}
    gap = "/".join(f"{(med[(c, 'contig_view')] - med[(c, 'mlx_lm')]) * 1e3:+.0f}" for c in CONTEXTS)
    paired = ratios("contig_view", kind="paired_ratio_vs_mlx_lm")
    view_big = ratios("contig_view", "attention_big_cache")
    paired_big = ratios("contig_view", "attention_big_cache", "paired_ratio_vs_mlx_lm")
    both = [x for _, x in view + view_big]
    ok = sum(x <= TARGET for x in both)
    out.append(f"Ratios are x mlx-lm at ctx {ctxs}. Batch 1 contiguous (zero-copy view): {span(view)}, paired "
               f"{span(paired)}; big-cache run {span(view_big)}, paired {span(paired_big)}: within 5 % at {ok} of "
               f"{len(both)} points (worst {max(both):.2f}); run-to-run noise here is about +-5 %. SDPA on the view "
               "costs the same as on a "
               f"dense array (exp. 2); of the {gap} us gap per step, `ArenaKVCache.update_and_fetch`'s Python is "
               f"{extra} us more than mlx-lm's (exp. 6), {starts} us of it the two O(blocks) "
               "`KVArena.contiguous_start` scans (write + read).")
    views8, db8 = ratios("contig_views"), ratios("contig_decodebatch")
    db8_big = ratios("contig_decodebatch", "attention_big_cache")
    faults = "/".join(f"{r['minor_faults_per_step']:.0f}" for r in data["attention"]
                      if r["variant"] == "contig_decodebatch")
    cache_mib = data["meta"]["mlx_default_cache_limit"] >> 20
    out.append(f"Batch 8 contiguous: per-sequence views {span(views8)} ({within(views8)}); DecodeBatch, which gathers "
               f"even contiguous tables, {span(db8)} with MLX's default {cache_mib} MiB CPU buffer cache (the gathered "
               f"[B,H,L,D] temporaries outgrow it and are page-faulted in afresh: {faults} minor faults per step) and "
               f"{span(db8_big)} with a {BIG_CACHE >> 20} MiB cache ({within(db8)} / {within(db8_big)}).")
    pg, pdb = ratios("paged_gather"), ratios("paged_decodebatch")
    pg_big, pdb_big = ratios("paged_gather", "attention_big_cache"), ratios("paged_decodebatch", "attention_big_cache")
    out.append(f"Paged (gather then SDPA): batch 1 {span(pg)} ({span(pg_big)} big cache), batch 8 DecodeBatch "
               f"{span(pdb)} ({span(pdb_big)} big cache); a peer measured 1.50-1.67 at long context.")
    lay = {(r["ctx"], r["layout"][:5]): r["ratio_vs_dense"] for r in data["layout"]}
    lctx = sorted({c for c, _ in lay})
    b = data["buffer_per_layer"]
    per, single = b["one buffer per layer"], b["one [L,H,S,D] buffer"]
    write_ms = "/".join(fmt(r["median_ms"]) for r in data["write_in_place"])
    write_mb = "/".join(f"{r['mb_per_buffer']:.0f}" for r in data["write_in_place"])
    out.append("Layout: SDPA on a head-major view costs " + "/".join(f"{lay[(c, 'head-')]:.2f}" for c in lctx)
               + " x a dense array at ctx " + "/".join(map(str, lctx)) + ", on a token-major view "
               + "/".join(f"{lay[(c, 'token')]:.2f}" for c in lctx) + " x. One buffer for all layers: a "
               f"{b['layers']}-layer step takes {single['median_ms']:.0f} ms and {single['extra_peak_mb']:.0f} MB "
               f"extra peak vs {per['median_ms']:.1f} ms and {per['extra_peak_mb']:.1f} MB with one buffer per layer "
               "(each write copies the whole buffer while the previous layer's view holds it); a per-layer write "
               f"stays in place ({write_ms} ms for {write_mb} MB buffers, exp. 4).")
    p = data["per_sequence_pitfall"]
    bad, good = p["update_and_fetch per sequence, one graph"], p["all writes, then views"]
    out.append(f"Pitfall: {p['batch']} `ArenaKVCache.update_and_fetch` calls in one graph copy the arena buffer at "
               f"each write ({bad['median_ms']:.1f} ms, {bad['extra_peak_mb']:.0f} MB extra peak vs "
               f"{good['median_ms']:.1f} ms, {good['extra_peak_mb']:.0f} MB with all writes first).")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, noisier numbers)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    args = parser.parse_args()
    if not openblas_loaded():
        print(f"hint: run with LD_PRELOAD={OPENBLAS} for OpenBLAS matmuls (recorded in the JSON)", file=sys.stderr)
    warmup, steps = (2, 10) if args.quick else (5, 30)
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    t_start = time.perf_counter()
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        data: dict[str, Any] = {"meta": machine_meta(args, warmup, steps)}
        data["attention"] = experiment_attention(warmup, steps, progress, rng, None)
        data["attention_big_cache"] = experiment_attention(warmup, steps, progress, rng, BIG_CACHE)
        data["layout"] = experiment_layout(warmup, steps, progress)
        data["buffer_per_layer"] = experiment_buffer_per_layer(1, 1 if args.quick else 3, progress)
        data["write_in_place"] = experiment_write_in_place(warmup, steps, progress)
        data["per_sequence_pitfall"] = experiment_pitfall(warmup, steps, progress, rng)
        data["python_overhead"] = experiment_python_overhead(progress, rng, 50 if args.quick else 200)
    data["meta"]["elapsed_s"] = time.perf_counter() - t_start
    data["conclusions"] = conclusions(data)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "arena_attention.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "arena_attention.md").write_text(to_markdown(data))
    for r in data["attention"]:
        print(f"ctx={r['ctx']:>5} B={r['batch']} {r['label']:<46} {r['median_ms']:8.3f} ms  "
              f"x{r['ratio_vs_mlx_lm']:.2f}")
    print("\n".join(data["conclusions"]))
    print(f"wrote {args.out / 'arena_attention.json'} and arena_attention.md in {data['meta']['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
