"""Batched decode attention over quantized blocks as the arena lays them out (`python -m bench.kv_quant_layout`).

`bench.kv_quant_attention` times the quantized matmul on contiguous operands. In the arena, a sequence's rows are
a slice of each layer's `[1, H, S, ...]` arrays: contiguous per KV head, not across heads, and MLX's quantized
matmul copies an operand that is not contiguous. This times one layer of a batch-8 decode step through the
engine's own code (a `DecodeBatch` per step over two layers: write the new rows, attend, advance) for float32 and
int8/int4 read three ways:
- `strided`: one call over strided views of the codes (`quantized_strided`);
- `per_head`: one pair of products per sequence and KV head over contiguous rows (`quantized_per_head`);
- `contiguous`: the strided views copied to contiguous arrays once, outside the timing: the floor, not a path.
The float32 row is the engine's own choice (`auto`: strided or blocks by length). SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64, group 64), float32 scales, random K/V.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import mlx.core as mx

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.benchmarks.runner import run_as_script
from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.quantized_attention import decode_attention
from cortexstream.kv.quantized_blocks import CodeView
from cortexstream.kv.sequence_kv import SequenceKV

BATCH, KV_HEADS, GROUP_HEADS, DIM, BLOCK, LAYERS = 8, 3, 3, 64, 16, 2


def build(storage: str | None, keys: int) -> tuple[KVArena, list[SequenceKV]]:
    kv = parse_kv_dtype(storage, 64, model_dtype="float32") if storage else None
    blocks = BATCH * (keys // BLOCK + 16)
    arena = KVArena(ArenaConfig(LAYERS, KV_HEADS, DIM, blocks, BLOCK, "float32", kv_dtype=kv), preallocate=True)
    sequences = []
    for owner in range(BATCH):
        seq = SequenceKV(arena, owner=owner)
        seq.ensure_capacity(keys + 256)
        for layer in range(LAYERS):
            arena.write(layer, seq.blocks, 0, mx.random.normal((KV_HEADS, keys, DIM)),
                        mx.random.normal((KV_HEADS, keys, DIM)))
        seq.lengths, seq.offsets = [keys] * LAYERS, [keys] * LAYERS
        sequences.append(seq)
    mx.eval(arena.arrays())
    return arena, sequences


def step_call(arena: KVArena, sequences: list[SequenceKV], way: str | None) -> Callable[[], list[mx.array]]:
    """One engine decode step over every layer (a new `DecodeBatch`, write + attend, then the counters advance),
    with the quantized way forced; `contiguous` attends over copies made once (its keys do not grow)."""
    queries = mx.random.normal((BATCH, KV_HEADS * GROUP_HEADS, 1, DIM))
    new = mx.random.normal((BATCH, KV_HEADS, 1, DIM))
    if way == "contiguous":
        batch = DecodeBatch(arena, sequences)
        width = int(batch.lengths_after.max())
        views = [[CodeView(*(mx.contiguous(a) for a in side[:3]), side.bits, side.group_size)
                  for side in arena.strided_rows(layer, BATCH, batch.strided, width)] for layer in range(LAYERS)]
        mx.eval([a for layer in views for v in layer for a in v[:3]])
        return lambda: [decode_attention(queries, *views[layer], 0.125) for layer in range(LAYERS)]

    def call() -> list[mx.array]:
        batch = DecodeBatch(arena, sequences)
        if way is not None:
            batch.quantized_per_head = way == "per_head"
            batch.quantized_strided = way == "strided"
        outs = []
        for cache in batch.caches():
            keys, values = cache.update_and_fetch(new, new)
            outs.append(cache.attend(queries, keys, values, 0.125, batch.step_mask))
        batch.commit()
        return outs + arena.arrays()

    return call


def measure(keys: int, steps: int) -> list[dict]:
    cases: dict[tuple[str, str], Callable[[], list[mx.array]]] = {}
    for storage in ("float32", "int8", "int4"):
        for way in ["auto"] if storage == "float32" else ["strided", "per_head", "contiguous"]:
            arena, sequences = build(None if storage == "float32" else storage, keys)  # one arena per case
            cases[(storage, way)] = step_call(arena, sequences, None if storage == "float32" else way)
    names = list(cases)
    for name in names:
        for _ in range(2):
            mx.eval(cases[name]())
    times: dict[tuple[str, str], list[float]] = {name: [] for name in names}
    for step in range(steps):
        for name in names[step % len(names):] + names[: step % len(names)]:
            tic = time.perf_counter()
            mx.eval(cases[name]())
            times[name].append((time.perf_counter() - tic) / LAYERS)
    base = statistics.median(times[("float32", "auto")])
    return [dict(keys=keys, storage=s, way=w, ms=statistics.median(t) * 1e3, vs_float=statistics.median(t) / base)
            for (s, w), t in times.items()]


def report(payload: dict) -> str:
    lines = ["# Quantized decode attention in the arena's layout (`python -m bench.kv_quant_layout`)", "",
             f"{machine_sentence(payload['machine'])}. Batch {BATCH}, SmolLM2's shapes, float32 scales; one engine "
             f"step (write + attend, {LAYERS} layers, keys growing by one a step) per call, per layer; median of "
             f"{payload['steps']} calls, cases interleaved.", "",
             "| keys | storage | read by | ms per layer | vs float32 |", "|---:|---|---|---:|---:|"]
    for r in payload["rows"]:
        lines.append(f"| {r['keys']} | {r['storage']} | {r['way']} | {r['ms']:.2f} | {r['vs_float']:.2f}x |")
    return "\n".join(lines + [""])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", default="512,1024,2048,4096", help="comma-separated keys per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed calls per case")
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    rows = []
    for keys in [int(k) for k in args.keys.split(",")]:
        rows += measure(keys, args.steps)
        print(f"{keys} keys: done", flush=True)
    payload = dict(benchmark="kv_quant_layout", machine=machine(), steps=args.steps, rows=rows,
                   elapsed_s=time.perf_counter() - start)
    write_results(args.out, "kv_quant_layout", payload, report(payload))
    print(report(payload))
    return 0


def main(argv: list[str] | None = None) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()
    return run_as_script(__doc__, add_arguments, run_from_args, argv, prog="python -m bench.kv_quant_layout")


if __name__ == "__main__":
    raise SystemExit(main())
