"""`cortexstream bench serve`: cortexstream serve vs mlx_lm.server on the same weights, over real HTTP streaming.

For each workload both servers are started as subprocesses (127.0.0.1, ephemeral ports; the one that goes first
alternates between workloads), driven with the same seeded workload by async streaming clients, and stopped; a
fresh process per workload keeps each peak RSS about that workload. The memory_bound workload (not run by default)
holds CortexStream to one KV byte budget per --kv-dtypes entry, beside mlx_lm.server and the peers given with
--peer-python (serve_memory.py). Writes `<out>/<name>.json`, `.md`, `.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cortexstream.benchmarks.common import write_report
from cortexstream.benchmarks.serve_memory_options import MemoryBoundOptions, add_memory_arguments, memory_options
from cortexstream.benchmarks.serve_processes import SYSTEMS, Launch, start_server
from cortexstream.benchmarks.serve_report import (
    DEFAULT_SPECULATIVE, SPECULATIVE_SYSTEM, markdown, plot, ratios, speculative_ratios, summarize)
from cortexstream.benchmarks.serve_workloads import MEMORY_BOUND, WORKLOAD_NAMES, build_workloads
from cortexstream.errors import InvalidArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: smollm2-135m); converted once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=8.0, help="workload 1 Poisson arrival rate (requests/s)")
    parser.add_argument("--kv-tokens", type=int, default=20480,
                        help="cortexstream serve's arena budget (tokens; its buffers grow on demand up to it)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--workloads", default="shared_system_chat,multi_turn,unrelated",
                        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)} ({MEMORY_BOUND}: not by default)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, from {', '.join(SYSTEMS + (SPECULATIVE_SYSTEM,))} ({SPECULATIVE_SYSTEM}: "
                        "cortexstream serve with --speculative SPEC as its default)")
    parser.add_argument("--speculative", default=DEFAULT_SPECULATIVE,
                        help=f"what {SPECULATIVE_SYSTEM} drafts with (default: {DEFAULT_SPECULATIVE})")
    add_memory_arguments(parser, MEMORY_BOUND)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per workload and system")
    parser.add_argument("--quick", action="store_true", help="smoke run: a few tiny requests (not a measurement)")
    parser.add_argument("--out", default="bench/results", help="output folder")
    parser.add_argument("--name", default=None, help="file name stem (default: serve, serve_memory_bound when "
                        "that is the only workload; _quick added with --quick)")


def machine_line() -> str:
    from cortexstream.backend import find_openblas

    blas = "OpenBLAS (preloaded for every server)" if find_openblas() and not os.environ.get(
        "CORTEXSTREAM_NO_OPENBLAS") else "MLX's bundled BLAS"
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {blas}"


def convert_to_mlx_lm(source: str | None, out_dir: Path) -> None:
    """`cortexstream convert SOURCE OUT_DIR` in a subprocess (SmolLM2 when SOURCE is None)."""
    cmd = [sys.executable, "-m", "cortexstream.cli.main", "convert", source or "smollm2-135m", str(out_dir)]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0:
        raise RuntimeError(f"convert failed: {run.stderr.strip()[-500:]}")


def require_httpx() -> None:
    """The clients speak HTTP through httpx, which only the `bench` extra installs: a clear error without it."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        from cortexstream.errors import CortexStreamError

        raise CortexStreamError("bench serve needs httpx (its HTTP clients), which is not installed: "
                                "pip install 'cortexstream[bench]'") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_httpx()
    from transformers import AutoTokenizer

    from cortexstream.benchmarks.serve_client import drive

    systems, wanted, options = check_args(args)
    work = Path(tempfile.mkdtemp(prefix="cortexstream-bench-serve-"))
    try:
        model_dir = work / "model"
        print(f"[bench serve] converting {args.model or 'smollm2-135m'} to an mlx-lm directory", flush=True)
        convert_to_mlx_lm(args.model, model_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        workloads = [w for w in build_workloads(tokenizer, args.seed, args.quick, args.rate) if w.name in wanted]
        result: dict[str, Any] = {
            "machine": machine_line(), "model": Path(args.model).stem if args.model else "smollm2-135m",
            "seed": args.seed, "quick": args.quick, "kv_tokens": args.kv_tokens, "max_num_seqs": args.max_num_seqs,
            "command": "cortexstream bench serve " + " ".join(_argv_of(args, options)), "workloads": [],
        }
        for index, workload in enumerate(workloads):
            order = systems if index % 2 == 0 else list(reversed(systems))
            entry: dict[str, Any] = {"name": workload.name, "description": workload.description, "order": order,
                                     "systems": {}}
            for system in order:
                print(f"[bench serve] {workload.name}: {system}", flush=True)
                server = start_server(launch_of(system, args), str(model_dir), work)
                try:
                    measured = asyncio.run(drive(server.url, workload, args.timeout, server.model))
                    entry["systems"][system] = summarize(measured, server.peak_rss)
                finally:
                    server.stop()
                s = entry["systems"][system]
                print(f"[bench serve]   {s['output_tokens_per_s']:.1f} output tok/s, TTFT p50 "
                      f"{(s['ttft_p50_s'] or 0) * 1e3:.0f} ms, peak RSS {s['peak_rss_mib']:.0f} MiB, "
                      f"{s['failed']} failed", flush=True)
            if set(entry["systems"]) >= {"cortexstream", "mlx_lm"}:
                entry["ratios"] = ratios(workload.name, entry["systems"]["cortexstream"], entry["systems"]["mlx_lm"])
            if set(entry["systems"]) >= {"cortexstream", SPECULATIVE_SYSTEM}:
                entry["speculative_ratios"] = speculative_ratios(entry["systems"][SPECULATIVE_SYSTEM],
                                                                 entry["systems"]["cortexstream"])
            result["workloads"].append(entry)
        if options is not None:
            from cortexstream.benchmarks.serve_memory import run_memory_bound

            result["memory_bound"] = run_memory_bound(options, model_dir, tokenizer, work, systems, seed=args.seed,
                                                      quick=args.quick, timeout=args.timeout)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str], MemoryBoundOptions | None]:
    """(systems, workloads, the memory_bound settings or None) from the command line, every option refused now
    (before the model is converted) if it is wrong or would have no effect."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    wanted = [w.strip().replace("-", "_") for w in args.workloads.split(",") if w.strip()]
    for name in wanted:
        if name not in WORKLOAD_NAMES:
            raise InvalidArgumentError(f"--workloads: {name!r} is not one of {', '.join(WORKLOAD_NAMES)}")
    for name in systems:
        if name not in SYSTEMS + (SPECULATIVE_SYSTEM,):
            raise InvalidArgumentError(f"--systems: {name!r} is not one of {', '.join(SYSTEMS + (SPECULATIVE_SYSTEM,))}"
                                       " (peers run with --peer-python)")
    if SPECULATIVE_SYSTEM in systems:
        from cortexstream.engine.speculative_config import parse_speculative

        parse_speculative(args.speculative)  # a bad spec is refused now, naming --speculative
    if not systems or not wanted:
        raise InvalidArgumentError("--systems / --workloads: give at least one of each")
    return systems, wanted, memory_options(args, MEMORY_BOUND in wanted, MEMORY_BOUND)


def launch_of(system: str, args: argparse.Namespace) -> Launch:
    """How to start `system` for a workload: the speculative variant is cortexstream with a --speculative default."""
    if system == SPECULATIVE_SYSTEM:
        return Launch("cortexstream", args.kv_tokens, args.max_num_seqs, speculative=args.speculative)
    return Launch(system, args.kv_tokens, args.max_num_seqs)


def _argv_of(args: argparse.Namespace, options: MemoryBoundOptions | None) -> list[str]:
    out = ["--workloads", args.workloads, "--systems", args.systems]
    out += ["--speculative", args.speculative] if SPECULATIVE_SYSTEM in args.systems else []
    for key in ("seed", "rate", "kv_tokens", "max_num_seqs"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + (options.argv() if options is not None else []) + (["--quick"] if args.quick else [])


def run_from_args(args: argparse.Namespace) -> int:
    require_httpx()  # before converting the model
    _, wanted, _ = check_args(args)
    result = run(args)
    stem = args.name or "serve" + ("_memory_bound" if wanted == [MEMORY_BOUND] else "") + (
        "_quick" if args.quick else "")
    write_report(str(args.out), stem, result, markdown(result), plot)
    print(f"[bench serve] wrote {Path(args.out) / stem}.json/.md/.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.serve")


if __name__ == "__main__":
    raise SystemExit(main())
