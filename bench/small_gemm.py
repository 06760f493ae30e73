"""The small-batch matmul kernel against MLX's BLAS matmul: all Linear layers of a SmolLM2-shaped decode step.

One "pass" multiplies x [M, 576] by every weight of SmolLM2-135M (30 layers x q, k, v, o, gate, up, down, plus the
tied 49152 x 576 output head: 538 MB of float32), as a decode step of M sequences does, through MLX's own
`nn.Linear` calls. The kernel is the BLAS interposer of kernels/small_gemm.c with its row limit set for the kernel
runs and 0 for the BLAS runs, so both go through the same MLX graph; only the sgemm underneath differs. Random
weights of SmolLM2's shapes (no model file needed). The two paths alternate pass by pass; median of `--passes`.
This is a diagnostic of one phase; the whole-call comparisons are `bench throughput` and `bench serve`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rich.progress import Progress
from cortexstream.benchmarks.runner import run_as_script

LAYERS, HIDDEN, INTERMEDIATE, KV, VOCAB = 30, 576, 1536, 192, 49152
ROWS = (1, 2, 4, 8, 12, 16, 24, 32)


def _weights() -> list:
    import mlx.core as mx
    import mlx.nn as nn

    mx.random.seed(0)
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
              (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    layers = [nn.Linear(i, o, bias=False) for _ in range(LAYERS) for o, i in shapes]
    layers.append(nn.Linear(HIDDEN, VOCAB, bias=False))
    for layer in layers:
        mx.eval(layer.parameters())
    return layers


def _one_pass(layers: list, rows: int) -> float:
    import mlx.core as mx

    x_hidden = mx.random.normal((rows, HIDDEN))
    x_inter = mx.random.normal((rows, INTERMEDIATE))
    mx.eval(x_hidden, x_inter)
    start = time.perf_counter()
    mx.eval([layer(x_inter if layer.weight.shape[1] == INTERMEDIATE else x_hidden) for layer in layers])
    return time.perf_counter() - start


def measure(passes: int, warmup: int, progress: Progress) -> list[dict]:
    from cortexstream.kernels import small_gemm

    if small_gemm.interposer() is None:
        raise SystemExit("bench small-gemm: this process does not have the interposer preloaded (run it through "
                         "the `cortexstream` command on Linux with a C compiler)")
    layers = _weights()
    task = progress.add_task("small-gemm", total=len(ROWS))
    rows_out = []
    for rows in ROWS:
        times: dict[str, list[float]] = {"blas": [], "kernel": []}
        for i in range(warmup + passes):
            for path in ("blas", "kernel") if i % 2 == 0 else ("kernel", "blas"):
                small_gemm.set_row_limit(rows if path == "kernel" else 0)
                try:
                    elapsed = _one_pass(layers, rows)
                finally:
                    small_gemm.set_row_limit(0)
                if i >= warmup:
                    times[path].append(elapsed)
        blas, kernel = statistics.median(times["blas"]), statistics.median(times["kernel"])
        rows_out.append({"rows": rows, "blas_ms": blas * 1e3, "kernel_ms": kernel * 1e3, "speedup": blas / kernel,
                         "blas_all_ms": [t * 1e3 for t in times["blas"]],
                         "kernel_all_ms": [t * 1e3 for t in times["kernel"]]})
        progress.advance(task)
    return rows_out


def to_markdown(data: dict) -> str:
    from cortexstream.benchmarks.machine import machine_sentence

    weight_mb = data["weight_bytes"] / 1e6
    lines = [
        "# Small-batch matmul kernel vs MLX's BLAS matmul (a SmolLM2-shaped decode step's Linear layers)", "",
        f"`python -m bench.small_gemm`; {machine_sentence(data['machine'])}. One pass = every Linear of "
        f"SmolLM2-135M ({weight_mb:.0f} MB float32, random weights) on M rows through `nn.Linear`; median of "
        f"{data['passes']} passes, the two paths alternating. A diagnostic of one phase, not a whole call.", "",
        "| rows (M) | BLAS ms | kernel ms | kernel speed-up | BLAS GB/s | kernel GB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(f"| {r['rows']} | {r['blas_ms']:.1f} | {r['kernel_ms']:.1f} | {r['speedup']:.2f}x | "
                     f"{data['weight_bytes'] / r['blas_ms'] / 1e6:.1f} | {data['weight_bytes'] / r['kernel_ms'] / 1e6:.1f} |")
    wins = [r["rows"] for r in data["rows"] if r["speedup"] > 1.0]
    lines += ["", f"The kernel is faster at M in {wins}; the engine's default row limit is "
              f"{data['engine_default_rows']} (backend/small_batch.py)."]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))


def run_from_args(args: argparse.Namespace) -> int:
    from cortexstream.benchmarks.common import write_results
    from cortexstream.benchmarks.machine import machine
    from cortexstream.backend import DEFAULT_MAX_ROWS

    if args.passes < 1 or args.warmup < 0:
        raise SystemExit("bench small-gemm: --passes must be >= 1 and --warmup >= 0")
    weight_bytes = 4 * (LAYERS * (2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * INTERMEDIATE * HIDDEN) + VOCAB * HIDDEN)
    with Progress() as progress:
        rows = measure(args.passes, args.warmup, progress)
    data = {"machine": machine(), "passes": args.passes, "warmup": args.warmup, "weight_bytes": weight_bytes,
            "engine_default_rows": DEFAULT_MAX_ROWS, "rows": rows}
    markdown = to_markdown(data)
    write_results(str(args.out), "small_gemm", data, markdown)
    print(markdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.small_gemm")


if __name__ == "__main__":
    main()
