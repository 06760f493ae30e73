"""Shapes, constants and timing primitives shared by all the arena attention experiments."""

from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig

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

# Batch-8 variants through the engine's DecodeBatch: (key suffix, strategy); None = the engine's default choice
BATCH_STRATEGIES = (
    ("decodebatch", None),
    ("decodebatch_strided", "strided"),
    ("decodebatch_blocks", "blocks"),
    ("decodebatch_perseq", "per_sequence"),
    ("decodebatch_gather", "gather"),
)

LABELS = {
    "mlx_lm": "mlx-lm KVCache (baseline)",
    "mlx_lm_mask": "mlx-lm KVCache + padding mask (ref.)",
    "mlx_lm_twin": "mlx-lm KVCache, a second copy (noise control)",
    "contig_view": "arena contiguous: ArenaKVCache view",
    "contig_decodebatch": "arena contiguous: engine DecodeBatch, default strategy",
    "contig_decodebatch_strided": "arena contiguous: DecodeBatch, one SDPA over strided views",
    "contig_decodebatch_blocks": "arena contiguous: DecodeBatch, block-wise gather_mm",
    "contig_decodebatch_perseq": "arena contiguous: DecodeBatch, per-sequence views + SDPA each",
    "contig_decodebatch_gather": "arena contiguous: DecodeBatch, padded gather (old path)",
    "contig_views": "arena contiguous: per-sequence views",
    "paged_gather": "arena paged (shuffled): ArenaKVCache gather",
    "paged_decodebatch": "arena paged (interleaved): engine DecodeBatch, default strategy",
    "paged_decodebatch_blocks": "arena paged (interleaved): DecodeBatch, block-wise gather_mm",
    "paged_decodebatch_perseq": "arena paged (interleaved): DecodeBatch, per-sequence (paged rows: one gather)",
    "paged_decodebatch_gather": "arena paged (interleaved): DecodeBatch, padded gather (old path)",
}


def minor_faults() -> int:
    """Minor page faults of this process so far: fresh pages the OS had to map (memory not reused)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def extra_peak(base: int) -> int:
    """Peak MLX memory since `mx.reset_peak_memory()` above `base` (the peak restarts at 0, not at what is live)."""
    return max(mx.get_peak_memory(), base) - base


def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None = None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)



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



def make_arena(num_blocks: int) -> KVArena:
    # Preallocated: the experiments measure (and report) a buffer of the whole arena's size, never a growing one.
    return KVArena(ArenaConfig(1, KV_HEADS, HEAD_DIM, num_blocks, BLOCK, "float32"), preallocate=True)


def arena_blocks(batch: int, tokens_per_seq: int) -> tuple[int, int]:
    """(blocks per sequence, arena blocks with SPARE headroom)."""
    per_seq = -(-tokens_per_seq // BLOCK)
    return per_seq, int(np.ceil(batch * per_seq * (1 + SPARE)))



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


def versus(variant: Variant, base: Variant) -> dict[str, float]:
    """A variant against the baseline run interleaved with it: its median step (ms), the ratio of medians, the
    median of same-round ratios (robust to load drift) and the max abs difference of their first outputs."""
    median, base_median = statistics.median(variant.times), statistics.median(base.times)
    return {
        "ms": median * 1e3,
        "ratio": median / base_median,
        "paired": statistics.median(t / t0 for t, t0 in zip(variant.times, base.times)),
        "max_abs_diff": float(mx.max(mx.abs(variant.first_out - base.first_out)).item()),
    }


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
    """One step of each variant per round. The order rotates every round: a variant's place in the round changes
    what is still in the CPU caches when it runs (each reads megabytes of its own K/V): in a fixed order two identical
    mlx-lm caches measured 3 % apart at 2k and 8k context (the second faster); rotated, 0-1 %."""
    n = len(variants)
    for i in range(warmup + steps):
        for j in range(n):
            variants[(i + j) % n].run_step(timed=i >= warmup)
        advance()

