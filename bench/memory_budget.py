"""Does `cortexstream serve --max-memory` keep the process within its budget? `python -m bench.memory_budget`.

    python -m bench.memory_budget [--max-memory 1.6GiB] [--sessions 8] [--turns 4] [--quick] [--out DIR]

Starts `cortexstream serve --max-memory X --kv-disk <temporary dir> --max-num-seqs <sessions>` (SmolLM2 unless
--model) as a subprocess and reads from its /metrics how the budget was split and how many KV blocks the arena got.
Then `--sessions` conversations run at once, streaming over HTTP, each turn resending the conversation so far
(`cortexstream.benchmarks.serve_workloads.memory_bound`: every session opens with its own history text, nothing is
shared), sized so that their final contexts add up to `--kv-factor` (2) times the arena: the arena cannot hold
them together, so requests wait for blocks and running ones are preempted (blocks the disk tier holds come back
from there instead of being recomputed; the report counts them). The server's resident memory is sampled every
0.1 s and its peak (VmHWM on Linux, else the sampled maximum) read before it stops. The report: the budget and its
planned split, peak RSS after start-up and over the whole run, whether the peak stayed within the budget, requests
completed / failed / refused with 429, and preemptions and disk-tier restores from /metrics.

`--quick` is a smoke run (a smaller budget, 4 sessions of 2 short turns), not a measurement; its results go to
`memory_budget_quick.*` so that they never replace a full run's.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
from pathlib import Path
from typing import Any

from cortexstream.benchmarks.common import show_report, write_results
from cortexstream.benchmarks.machine import machine
from cortexstream.benchmarks.runner import run_as_script
from cortexstream.benchmarks.serve_processes import Launch, rss_bytes, start_server
from cortexstream.models.loader import default_model_path

MIB = 2**20
MESSAGE_OVERHEAD = 6  # chat-template tokens around one message (SmolLM2's template: 5 and a newline)
_SAMPLE = re.compile(r'^(cortexstream:[a-z_]+)\{([^}]*)\} (\S+)$')
FULL = {"max_memory": "1.6GiB", "sessions": 8, "turns": 4, "user_tokens": (20, 60), "new_tokens": (32, 64),
        "timeout": 3600.0}
QUICK = {"max_memory": "1.35GiB", "sessions": 4, "turns": 2, "user_tokens": (10, 20), "new_tokens": (8, 16),
         "timeout": 300.0}


def read_metrics(url: str) -> dict[str, list[tuple[str, float]]]:
    """/metrics as name -> [(labels, value)], cortexstream's own lines only."""
    import httpx

    out: dict[str, list[tuple[str, float]]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out.setdefault(match.group(1), []).append((match.group(2), float(match.group(3))))
    return out


def metric(metrics: dict[str, list[tuple[str, float]]], name: str, label: str = "") -> float | None:
    """The value of `name` whose labels contain `label` (None when the page has none)."""
    for labels, value in metrics.get(f"cortexstream:{name}", []):
        if label in labels:
            return value
    return None


def launch_of(args: argparse.Namespace, work: Path) -> Launch:
    """`cortexstream serve` under the budget with its disk tier in `work`."""
    return Launch("cortexstream", None, args.max_num_seqs or args.sessions, kv_disk=str(work / "kv"),
                  max_memory=args.max_memory)


def history_tokens(arena_tokens: int, args: argparse.Namespace) -> int:
    """Each session's opening history, so that the sessions' final contexts add up to kv_factor x the arena."""
    per_turn = sum(args.user_tokens) / 2 + sum(args.new_tokens) / 2 + 2 * MESSAGE_OVERHEAD
    per_session = args.kv_factor * arena_tokens / args.sessions
    history = int(per_session - args.turns * per_turn - MESSAGE_OVERHEAD)
    if history < 16 or per_session + args.new_tokens[1] >= arena_tokens:
        raise SystemExit(f"--sessions {args.sessions} x --turns {args.turns}: a session's final context "
                         f"({per_session:.0f} tokens) must fit in the arena ({arena_tokens} tokens) and leave room "
                         "for its opening history; use more sessions or fewer turns")
    return history


def run(args: argparse.Namespace) -> dict[str, Any]:
    from cortexstream.benchmarks.serve_client import drive
    from cortexstream.benchmarks.serve_workloads import memory_bound
    from cortexstream.models.loader import load

    _, tokenizer = load(args.model)  # the workload's texts are cut to token counts with the model's tokenizer
    with tempfile.TemporaryDirectory(prefix="memory-budget-") as tmp:
        work = Path(tmp)
        server = start_server(launch_of(args, work), args.model or default_model_path(), work, timeout=600)
        try:
            url = server.url
            startup_peak = rss_bytes(server.proc.pid, peak=True)
            before = read_metrics(url)
            plan = {labels.split('part="')[1].rstrip('"'): int(value)
                    for labels, value in before.get("cortexstream:memory_plan_bytes", [])}
            budget = int(metric(before, "memory_budget_bytes") or 0)
            block_size = int(re.search(r'block_size="(\d+)"', before["cortexstream:kv_cache_config_info"][0][0])
                             .group(1))
            arena_tokens = int(metric(before, "kv_blocks_total") or 0) * block_size
            history = history_tokens(arena_tokens, args)
            workload = memory_bound(tokenizer, args.seed, args.sessions, history_tokens=history, turns=args.turns,
                                    user_tokens=args.user_tokens, new_tokens=args.new_tokens)
            need = sum(len(tokenizer.encode(s.system or "", add_special_tokens=False)) + MESSAGE_OVERHEAD
                       + sum(len(tokenizer.encode(t.user_text, add_special_tokens=False)) + t.max_tokens
                             + 2 * MESSAGE_OVERHEAD for t in s.turns) for s in workload.sessions)
            result = asyncio.run(drive(url, workload, args.timeout))
            after = read_metrics(url)
            peak = server.peak_rss
        finally:
            server.stop()
        log = server.log
        banner = [line.strip() for line in log.read_text().splitlines() if line.strip().startswith("memory:")]
    records = result.records
    failed = [r.error for r in records if r.error]
    return {
        "benchmark": "memory_budget", "quick": args.quick, "machine": machine(),
        "settings": {"max_memory": args.max_memory, "sessions": args.sessions, "turns": args.turns,
                     "max_num_seqs": args.max_num_seqs or args.sessions, "kv_factor": args.kv_factor,
                     "user_tokens": list(args.user_tokens), "new_tokens": list(args.new_tokens),
                     "history_tokens": history, "model": args.model or "smollm2-135m", "seed": args.seed},
        "budget_bytes": budget, "plan_bytes": plan, "banner": banner[0] if banner else None,
        "arena_tokens": arena_tokens, "kv_need_tokens": need,
        "peak_rss_startup_bytes": startup_peak, "peak_rss_bytes": peak, "rss_samples": server.rss_samples,
        "within_budget": peak <= budget,
        "requests": len(records), "completed": sum(1 for r in records if r.done and not r.error),
        "failed": len(failed), "refused_429": sum(1 for e in failed if e.startswith("HTTP 429")),
        "errors": sorted(set(failed))[:5], "wall_seconds": result.finished - result.started,
        "preemptions": metric(after, "num_preemptions_total"),
        "disk_hit_blocks": metric(after, "kv_disk_hit_blocks_total"),
        "disk_restored_blocks": metric(after, "kv_disk_restored_blocks_total"),
        "disk_restored_tokens": metric(after, "kv_disk_restored_tokens_total"),
        "disk_puts": metric(after, "kv_disk_puts_total"),
        "prefix_cache_hit_tokens": metric(after, "prefix_cache_hit_tokens_total"),
    }


def _mib(value: float) -> str:
    return f"{value / MIB:.0f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(p: dict[str, Any]) -> str:
    s = p["settings"]
    mib = _mib
    parts = " / ".join(f"{name} {mib(value)}" for name, value in p["plan_bytes"].items() if value)
    verdict = "yes" if p["within_budget"] else "**no**"
    return "\n".join([
        "# Memory budget: `cortexstream serve --max-memory` under a workload needing twice its arena"
        + (" (quick smoke run)" if p["quick"] else ""),
        "",
        f"{s['sessions']} conversations at once, {s['turns']} turns each (user turns {s['user_tokens'][0]}-"
        f"{s['user_tokens'][1]} tokens, {s['new_tokens'][0]}-{s['new_tokens'][1]} new tokens, each opening with its "
        f"own {s['history_tokens']}-token history), streaming, every turn resending the conversation; "
        f"--max-num-seqs {s['max_num_seqs']}, --kv-disk on. Model {s['model']}. Their final contexts need "
        f"{p['kv_need_tokens']} KV tokens; the arena the budget leaves holds {p['arena_tokens']}.",
        "",
        "| budget MiB | planned split MiB | peak RSS after start-up MiB | peak RSS MiB | within budget | "
        "requests ok / failed (429) | preemptions | disk restored blocks (tokens) | wall s |",
        "|---:|---|---:|---:|:---:|---:|---:|---:|---:|",
        f"| {mib(p['budget_bytes'])} ({s['max_memory']}) | {parts} | {mib(p['peak_rss_startup_bytes'])} | "
        f"{mib(p['peak_rss_bytes'])} | {verdict} | {p['completed']} / {p['failed']} ({p['refused_429']}) | "
        f"{_count(p['preemptions'])} | {_count(p['disk_restored_blocks'])} ({_count(p['disk_restored_tokens'])}) | "
        f"{p['wall_seconds']:.0f} |",
        "",
        "Peak RSS is the server process's VmHWM (its whole life, model loading included) read before it stopped, or "
        f"the highest of {p['rss_samples']} samples taken every 0.1 s where there is no VmHWM.",
        *([f"Errors: {'; '.join(p['errors'])}"] if p["errors"] else []),
        "",
    ])


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-memory", default=None, help=f"the server's budget (default {FULL['max_memory']}; "
                        f"--quick {QUICK['max_memory']})")
    parser.add_argument("--sessions", type=int, default=None, help="conversations at once (default 8; --quick 4)")
    parser.add_argument("--turns", type=int, default=None, help="turns per conversation (default 4; --quick 2)")
    parser.add_argument("--user-tokens", type=_pair, default=None, metavar="LOW,HIGH")
    parser.add_argument("--new-tokens", type=_pair, default=None, metavar="LOW,HIGH")
    parser.add_argument("--kv-factor", type=float, default=2.0,
                        help="the sessions' final contexts as a multiple of the arena (default 2)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the server's (default: --sessions)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model to serve (default: smollm2-135m)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: smaller budget, 4 short sessions")
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("sessions", "turns"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: {getattr(args, name)} must be >= 1")
    if not args.kv_factor > 0:
        raise SystemExit(f"--kv-factor: {args.kv_factor} must be > 0")
    payload = run(args)
    name = "memory_budget_quick" if args.quick else "memory_budget"
    write_results(args.out, name, payload, markdown(payload))
    show_report(args.out, name)
    return 0 if payload["within_budget"] and not payload["failed"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.memory_budget")


if __name__ == "__main__":
    raise SystemExit(main())
