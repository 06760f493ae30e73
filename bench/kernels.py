"""Each custom kernel against its pure-MLX reference on the current device: `python -m bench.kernels`.

On a Mac with Metal both run and the table shows the speed-up; on Linux only the reference runs (the Metal kernels
cannot; their C++ twins in the tests are sanitizer builds, timing them would mean nothing). Shapes follow
SmolLM2-135M's attention (3 KV heads, 9 query heads, head_dim 64) with 16-token blocks and fragmented block
tables, since fragmentation is what the kernels are for. Times are medians of `repeats` evaluated calls after
warm-up; GB/s counts the bytes each operation must move at least (reads of the rows it uses plus its output).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.benchmarks.common import percentile, show_report, write_results
from cortexstream.benchmarks.machine import machine
from cortexstream.benchmarks.runner import run_as_script
from cortexstream.kernels import compress_gather as cg
from cortexstream.kernels import evict_gather as eg
from cortexstream.kernels import paged_attention as pa
from cortexstream.kernels.dispatch import METAL, REFERENCE, kernel_backend_description, metal_available

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16


def _time(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    for _ in range(3):
        mx.eval(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": percentile(samples, 50), "p10_ms": percentile(samples, 10), "p90_ms": percentile(samples, 90)}


def _cases(dtype: mx.Dtype, rng: np.random.Generator) -> list[dict[str, Any]]:
    """(name, description, bytes moved, {backend: zero-argument callable})."""
    item = np.dtype(np.float16 if dtype != mx.float32 else np.float32).itemsize
    blocks, tokens = 1024, 4096
    arena = [mx.array(rng.standard_normal((KV_HEADS, blocks * BLOCK, HEAD_DIM)).astype(np.float32)).astype(dtype)
             for _ in range(2)]
    table = [int(b) for b in rng.permutation(blocks)[: tokens // BLOCK]]
    keep = np.sort(np.stack([rng.choice(tokens, tokens // 2, replace=False) for _ in range(KV_HEADS)]), axis=1)
    row = HEAD_DIM * item
    factor, window = 4, 8
    w1 = mx.array(rng.standard_normal((HEAD_DIM, factor * HEAD_DIM)).astype(np.float32) * 0.05)
    b1 = mx.zeros((HEAD_DIM,))
    batch = 8
    lengths = [int(n) for n in rng.integers(512, 2049, size=batch)]
    max_blocks = -(-max(lengths) // BLOCK)
    tables = np.stack([rng.permutation(blocks)[:max_blocks] for _ in range(batch)]).astype(np.int32)
    queries = mx.array(rng.standard_normal((batch, Q_HEADS, 1, HEAD_DIM)).astype(np.float32)).astype(dtype)
    scale = HEAD_DIM ** -0.5
    attn_bytes = 2 * sum(lengths) * KV_HEADS * row
    mx.eval(arena, w1, b1, queries)
    cases = [
        ("evict_gather", f"keep {tokens // 2} of {tokens} tokens per KV head, K+V", 4 * KV_HEADS * (tokens // 2) * row,
         {b: (lambda b=b: eg.evict_gather(arena[0], arena[1], table, keep, BLOCK, backend=b))
          for b in (REFERENCE, METAL)}),
        ("compress_gather", f"{tokens} tokens, groups of {factor}, Linear {factor * HEAD_DIM}->{HEAD_DIM} + ReLU",
         KV_HEADS * tokens * row + KV_HEADS * tokens // factor * HEAD_DIM * 4,
         {b: (lambda b=b: cg.compress_gather(arena[0], table, 0, tokens // factor, factor, w1, b1, BLOCK, backend=b))
          for b in (REFERENCE, METAL)}),
        ("pack_windows", f"{tokens} tokens, windows of {window}", 2 * KV_HEADS * tokens * row,
         {b: (lambda b=b: cg.pack_windows(arena[0], table, 0, tokens // window, window, BLOCK, backend=b))
          for b in (REFERENCE, METAL)}),
        ("paged_attention", f"decode, batch {batch}, lengths 512-2048, {Q_HEADS}q/{KV_HEADS}kv heads", attn_bytes,
         {b: (lambda b=b: pa.paged_attention(queries, arena[0], arena[1], tables, lengths, scale, BLOCK, backend=b))
          for b in (REFERENCE, METAL)}),
        ("paged_attention+colsum", "same, plus the H2O column sums", attn_bytes,
         {b: (lambda b=b: pa.paged_attention(queries, arena[0], arena[1], tables, lengths, scale, BLOCK,
                                             colsum=True, backend=b)) for b in (REFERENCE, METAL)}),
    ]
    return [{"kernel": k, "shape": d, "bytes": n, "fns": f} for k, d, n, f in cases]


def run(out_dir: str = "bench/results", repeats: int = 20, dtype: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Time every kernel (and its reference) on this device; write kernels.json + kernels.md to `out_dir`.

    dtype: the arena/query dtype; default as the engine runs: float32 on CPU (models are loaded as float32
    there), float16 with Metal.
    """
    dtype = dtype or ("float16" if metal_available() else "float32")
    mx_dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    backends = [REFERENCE, METAL] if metal_available() else [REFERENCE]
    results = []
    for case in _cases(mx_dtype, np.random.default_rng(seed)):
        entry: dict[str, Any] = {"kernel": case["kernel"], "shape": case["shape"], "bytes": case["bytes"]}
        for backend in backends:
            timing = _time(case["fns"][backend], repeats)
            timing["gb_per_s"] = case["bytes"] / (timing["median_ms"] * 1e6)
            entry[backend] = timing
        if METAL in entry:
            entry["speedup"] = entry[REFERENCE]["median_ms"] / entry[METAL]["median_ms"]
        results.append(entry)
    payload = {"benchmark": "kernels", "machine": machine(), "device": str(mx.default_device()),
               "kernels": kernel_backend_description(), "dtype": dtype, "block_size": BLOCK,
               "heads": {"q": Q_HEADS, "kv": KV_HEADS, "head_dim": HEAD_DIM}, "repeats": repeats, "results": results}
    write_results(out_dir, "kernels", payload, _markdown(payload, backends))
    return payload


def _markdown(payload: dict[str, Any], backends: list[str]) -> str:
    m = payload["machine"]
    metal = METAL in backends

    def cell(entry: dict[str, Any], backend: str) -> str:
        t = entry[backend]
        return f"{t['median_ms']:.3f} ({t['gb_per_s']:.1f} GB/s)"

    header = "| kernel | shape | reference ms (GB/s) |" + (" metal ms (GB/s) | speed-up |" if metal else "")
    rule = "|---|---|---:|" + ("---:|---:|" if metal else "")
    rows = [f"| {e['kernel']} | {e['shape']} | {cell(e, REFERENCE)} |"
            + (f" {cell(e, METAL)} | {e['speedup']:.2f}x |" if metal else "") for e in payload["results"]]
    note = ("" if metal else "No Metal device: only the pure-MLX reference ran. The Metal kernels' timings need a "
            "Mac (`python -m bench.kernels` there); their correctness is checked here by tests/test_kernels.py.")
    return "\n".join([
        "# Custom kernels vs pure-MLX reference",
        "",
        f"Device {payload['device']}; kernels: {payload['kernels']}. dtype {payload['dtype']}, block size "
        f"{payload['block_size']}, {payload['heads']['q']} query / {payload['heads']['kv']} KV heads, head_dim "
        f"{payload['heads']['head_dim']}, fragmented block tables. Median of {payload['repeats']} evaluated calls.",
        f"Machine: {m['platform']}, {m['cpu_count']} cores, BLAS: {m['blas']}, mlx {m['mlx']}.",
        "",
        header, rule, *rows, "", note, "",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per kernel (median reported)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="arena/query dtype (default: float16 with Metal, else float32)")
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    from cortexstream.cli.number_lists import at_least

    run(args.out, repeats=at_least(args.repeats, "--repeats", 1), dtype=args.dtype)
    return show_report(args.out, "kernels")


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.kernels")


if __name__ == "__main__":
    raise SystemExit(main())
