"""Block size vs batched decode attention: contiguous and interleaved block tables, `blocks` strategy, batch 8.

Run: ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m bench.block_size``
(about 1 min; ``--engine``: also the engine end to end on SmolLM2, about 8 min more). Writes
bench/results/block_size.json and .md. The engine's paged block manager gives a growing
sequence one block at a time, so in the engine the tables of concurrent sequences interleave (sequence i owns
blocks i, i+B, ...), which is what the "interleaved" rows model. One attention layer's decode step (SmolLM2
shapes, float32) through the engine's DecodeBatch + SDPA hook with the `blocks` strategy forced, against mlx-lm's
KVCache; variants interleaved in a rotating order, as in bench_arena_attention.py. ``--engine`` adds the whole
engine's decode tok/s (SmolLM2 fp32, 8 concurrent requests, no prefix caching) at block size 16 vs 64, runs
alternated. Measurement only: the engine's default block size is not changed by it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from bench.arena_attention.cases import ArenaDecodeBatch, MlxLm
from bench.arena_attention.common import HEAD_DIM, KV_HEADS, SEED, SPARE, interleave, make_inputs, versus
from bench.arena_attention.meta import machine_line, machine_meta, steps_sentence
from rich.progress import Progress

from cortexstream.benchmarks.common import write_results
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.benchmarks.runner import run_as_script

BATCH = 8
BLOCK_SIZES = (16, 32, 64, 128)
CONTEXTS = (512, 2048, 8192)
LAYOUTS = ("contiguous", "interleaved")


def sequences(inp, block_size: int, layout: str, capacity: int) -> tuple[KVArena, list[SequenceKV]]:  # noqa: ANN001
    per_seq = -(-capacity // block_size)
    arena = KVArena(ArenaConfig(1, KV_HEADS, HEAD_DIM, int(per_seq * BATCH * (1 + SPARE)), block_size, "float32"),
                    preallocate=True)
    if layout == "contiguous":
        seqs = [SequenceKV(arena, owner=i, contiguous=True) for i in range(BATCH)]
        for seq in seqs:
            seq.ensure_capacity(capacity)
    else:
        blocks = arena.allocator.allocate(BATCH * per_seq, owner=0)
        seqs = [SequenceKV(arena, owner=0, contiguous=False, blocks=list(blocks[i::BATCH])) for i in range(BATCH)]
    for i, seq in enumerate(seqs):
        arena.write(0, seq.blocks, 0, inp.prefill_k[i], inp.prefill_v[i])
        seq.lengths[0] = seq.offsets[0] = inp.ctx
    mx.eval(arena.arrays())
    return arena, seqs


def measure(ctx: int, warmup: int, steps: int) -> list[dict]:
    inp = make_inputs(ctx, BATCH)
    variants = [MlxLm(inp)]
    for block_size in BLOCK_SIZES:
        for layout in LAYOUTS:
            arena, seqs = sequences(inp, block_size, layout, ctx + warmup + steps + 2)
            variants.append(ArenaDecodeBatch(f"{layout}/{block_size}", inp, arena, seqs, "blocks"))
    interleave(variants, warmup, steps, lambda: None)
    base = variants[0]
    rows = []
    for v in variants[1:]:
        layout, block_size = v.key.split("/")
        c = versus(v, base)
        rows.append({"ctx": ctx, "layout": layout, "block_size": int(block_size), "median_ms": c["ms"],
                     "mlx_lm_median_ms": statistics.median(base.times) * 1e3, "ratio_vs_mlx_lm": c["ratio"],
                     "paired_ratio_vs_mlx_lm": c["paired"], "max_abs_diff_vs_mlx_lm": c["max_abs_diff"]})
    return rows


def engine_decode(cases: list[tuple[int, int]], repeats: int, progress: Progress) -> list[dict]:
    """Decode tok/s of the engine (`num_decode_tokens / decode_time`) per block size, for (prompt, new) tokens."""
    from cortexstream.benchmarks.common import prompt_token_lists
    from cortexstream.engine.client import InProcessClient
    from cortexstream.engine.engine import Engine
    from cortexstream.models.loader import load

    model, tokenizer = load(None)
    rows = []
    task = progress.add_task("engine", total=len(cases) * (2 + 2 * repeats))
    for prompt_tokens, new_tokens in cases:
        prompts = prompt_token_lists(tokenizer, BATCH, prompt_tokens)

        def run(block_size: int) -> float:
            arena = KVArena(ArenaConfig.for_model(model, num_tokens=BATCH * (prompt_tokens + new_tokens + 128),
                                                  block_size=block_size), preallocate=True)  # timed: no growth
            engine = Engine(model, tokenizer, arena=arena, max_num_seqs=BATCH, prefix_caching=False,
                            block_size=block_size)
            client = InProcessClient(engine)
            for prompt in prompts:
                client.submit(prompt, max_tokens=new_tokens)
            client.run()
            client.close()
            progress.advance(task)
            return engine.num_decode_tokens / engine.decode_time

        run(16), run(64)  # warm-up
        tps: dict[int, list[float]] = {16: [], 64: []}
        for r in range(repeats):
            for block_size in ((16, 64) if r % 2 == 0 else (64, 16)):
                tps[block_size].append(run(block_size))
        rows.append({"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "decode_tps": tps,
                     "best_ratio_64_vs_16": max(tps[64]) / max(tps[16]),
                     "median_ratio_64_vs_16": statistics.median(tps[64]) / statistics.median(tps[16])})
    return rows


def to_markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        "# Block size vs batched decode attention (batch 8, `blocks` strategy)", "",
        f"{machine_line(meta, 'python -m bench.block_size')} {steps_sentence(meta)} Ratio x mlx-lm's "
        "`KVCache` (paired ratio in brackets). Interleaved = sequence i owns blocks i, i+8, ... (what the engine's "
        "one-block-at-a-time growth produces). Every output matched mlx-lm's to "
        f"{max(r['max_abs_diff_vs_mlx_lm'] for r in data['rows']):.0e}.", "",
        "| keys | " + " | ".join(f"{layout} {bs}" for bs in BLOCK_SIZES for layout in LAYOUTS) + " |",
        "|---:|" + "---:|" * (len(BLOCK_SIZES) * len(LAYOUTS)),
    ]
    for ctx in sorted({r["ctx"] for r in data["rows"]}):
        cells = []
        for bs in BLOCK_SIZES:
            for layout in LAYOUTS:
                r = next(r for r in data["rows"] if (r["ctx"], r["block_size"], r["layout"]) == (ctx, bs, layout))
                cells.append(f"{r['ratio_vs_mlx_lm']:.2f} ({r['paired_ratio_vs_mlx_lm']:.2f})")
        lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
    if data.get("engine"):
        lines += ["", "## The engine end to end (SmolLM2 fp32, 8 requests, decode tok/s, runs alternated)", "",
                  "| prompt + new tokens | block 16: runs | block 64: runs | 64 vs 16, best | 64 vs 16, median |",
                  "|---|---|---|---:|---:|"]
        for r in data["engine"]:
            runs = {bs: ", ".join(f"{x:.1f}" for x in r["decode_tps"][bs]) for bs in r["decode_tps"]}
            lines.append(f"| {r['prompt_tokens']} + {r['new_tokens']} | {runs[16]} | {runs[64]} | "
                         f"{r['best_ratio_64_vs_16']:.3f} | {r['median_ratio_64_vs_16']:.3f} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--engine", action="store_true", help="also the engine end to end on SmolLM2")
    parser.add_argument("--engine-repeats", type=int, default=3)


def run_from_args(args: argparse.Namespace) -> int:
    args.quick = False
    mx.random.seed(SEED)
    t0 = time.perf_counter()
    data: dict = {"meta": machine_meta(args, args.warmup, args.steps), "rows": []}
    with Progress() as progress:
        task = progress.add_task("block size", total=len(CONTEXTS))
        for ctx in CONTEXTS:
            data["rows"] += measure(ctx, args.warmup, args.steps)
            progress.advance(task)
        if args.engine:
            data["engine"] = engine_decode([(128, 128), (768, 48)], args.engine_repeats, progress)
    data["meta"]["elapsed_s"] = time.perf_counter() - t0
    markdown = to_markdown(data)
    write_results(str(args.out), "block_size", data, markdown)
    print(markdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.block_size")


if __name__ == "__main__":
    main()
