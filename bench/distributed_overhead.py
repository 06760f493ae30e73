"""What running on two ranks costs rank 0, and the tokens/s of one rank vs two: `python -m bench.distributed_overhead`.

    python -m bench.distributed_overhead [--models tiny,qwen] [--systems cortexstream,mlx_lm] [--requests 4]
                                         [--max-tokens 64] [--quick]

A diagnostic, not a timed test. For each model and system it runs the same greedy workload (`--requests` prompts
through `batch_generate`, one warm-up pass first) in one process and on two ranks on this machine (ring backend over
127.0.0.1, started as mlx.launch starts them), and reports:

- tokens/s (generated tokens / wall time of the timed pass) for 1 and 2 ranks, for CortexStream and for mlx-lm's own
  sharded generation (`mlx_lm.utils.sharded_load`, tensor parallel through the model's `shard`, then
  `mlx_lm.batch_generate` on every rank) on the same weights (the GGUF written as an mlx-lm directory by
  `cortexstream convert`);
- per step, the ms rank 0 spends encoding and sending each plan to the other rank, and the bytes sent
  (DistributedLeader.stats(), counted inside the leader);
- latency of one stream: the first prompt alone through each system's `stream_generate` after the timed batch,
  time to the first token and mean time per token after it (TTFT, TPOT).

Models: `tiny` (a random 2-layer model whose 4 query / 2 KV heads split over 2 ranks, written to a temporary GGUF)
and `qwen` (the verified Qwen2.5-Coder-0.5B-Instruct asset; skipped with the reason when absent). Two ranks on
one machine share its cores and memory bandwidth, so their tokens/s says what the split costs here, not what
two machines would gain. `--quick`: the tiny model, 2 requests of 8 tokens (a smoke run). Writes
bench/results/distributed.{json,md} (`--out` for another folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

RESULT = "distributed"


def _workload(tokenizer: Any, requests: int) -> list[list[int]]:
    """`requests` prompts of 24 to 24 + 8 * (requests - 1) tokens of ordinary text."""
    from cortexstream.evaluation.wiki_corpus import wiki_text

    tokens = tokenizer.encode(wiki_text()[0][:50_000])
    return [tokens[800 * i: 800 * i + 24 + 8 * i] for i in range(requests)]


def stream_latency(responses: Iterator[Any]) -> dict[str, float]:
    """TTFT and mean time per later token of a stream of one response per token (timed from the first `next`)."""
    start = time.perf_counter()
    times = [time.perf_counter() for _ in responses]
    if not times:
        raise RuntimeError("the stream returned no token")
    return {"ttft_s": times[0] - start, "tpot_s": (times[-1] - times[0]) / max(len(times) - 1, 1),
            "stream_tokens": len(times)}


def mlx_lm_worker(model_dir: str, requests: int, max_tokens: int, out: str) -> int:
    """mlx-lm on one rank (or alone): `sharded_load` splits the model over the launched group; every rank runs the
    same greedy `batch_generate` (the model's all-reduces keep them in step); rank 0 writes `out`."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import sharded_load

    from cortexstream.distributed import launched

    ranks = 1
    if launched():
        ranks = mx.distributed.init().size()
        model, tokenizer = sharded_load(model_dir)
    else:
        model, tokenizer = mlx_lm.load(model_dir)
    prompts = _workload(tokenizer, requests)
    mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=4)  # warm-up
    start = time.perf_counter()
    response = mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    seconds = time.perf_counter() - start
    generated = sum(len(ids) for ids in response.token_ids)
    latency = stream_latency(mlx_lm.stream_generate(model, tokenizer, prompts[0], max_tokens=max_tokens))
    if not launched() or mx.distributed.init().rank() == 0:
        json.dump({"seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds, "ranks": ranks,
                   **latency}, open(out, "w"))
    return 0


def worker(model_path: str, requests: int, max_tokens: int, out: str) -> int:
    """One rank (or the single process): load, run the workload twice (warm-up, timed), rank 0 writes `out`."""
    import cortexstream
    from cortexstream.distributed import DistributedSession, launched
    from cortexstream.engine.engine import Engine

    model, tokenizer = cortexstream.load(model_path)
    prompts = _workload(tokenizer, requests)

    def measure(engine: Engine) -> dict[str, Any]:
        cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=4, engine=engine)  # warm-up
        start = time.perf_counter()
        out = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, engine=engine,
                                          return_token_ids=True)
        seconds = time.perf_counter() - start
        generated = sum(len(ids) for ids in out.token_ids)
        latency = stream_latency(cortexstream.stream_generate(model, tokenizer, prompts[0], max_tokens=max_tokens,
                                                              engine=engine))
        return {"seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds, **latency}

    settings = {"kv_tokens": 4096, "max_num_seqs": max(requests, 1)}
    if not launched():
        result = measure(Engine(model, tokenizer, **settings))
        result["ranks"] = 1
        json.dump(result, open(out, "w"))
        return 0
    with DistributedSession.start(model, tokenizer, timeout=300) as ranks:
        if not ranks.is_leader:
            ranks.follow()
            return 0
        engine = ranks.attach(Engine(model, tokenizer, **settings))
        warm = ranks.leader.stats()
        result = measure(engine)
        after = ranks.leader.stats()
    steps = after["steps"] - warm["steps"]  # the timed pass's steps (the warm-up and the attach excluded)
    result.update(ranks=ranks.size, steps=steps,
                  relay_ms_per_step=1000 * (after["relay_seconds"] - warm["relay_seconds"]) / max(steps, 1),
                  plan_bytes_per_step=(after["bytes_sent"] - warm["bytes_sent"]) / max(steps, 1))
    json.dump(result, open(out, "w"))
    return 0


def _run(system: str, model_path: str, ranks: int, requests: int, max_tokens: int, folder: str,
         timeout: float) -> dict:
    from cortexstream.distributed.local_ranks import rank_environment, write_local_hostfile

    out = os.path.join(folder, f"{system}-ranks{ranks}-{os.path.basename(model_path)}.json")
    command = [sys.executable, "-m", "bench.distributed_overhead", "--worker", model_path, "--worker-system", system,
               "--requests", str(requests), "--max-tokens", str(max_tokens), "--worker-out", out]
    envs = [dict(os.environ)]
    if ranks == 2:
        hostfile = write_local_hostfile(folder)
        envs = [rank_environment(rank, hostfile) for rank in range(2)]
    procs = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) for env in envs]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise RuntimeError(f"{system} on {ranks} rank(s) on {model_path} did not finish within {timeout:g} s")
        if proc.returncode != 0:
            errors.append(err[-1500:])
    if errors:
        raise RuntimeError(f"{system} on {ranks} rank(s) on {model_path} failed: {errors}")
    return json.load(open(out))


def _model_path(name: str, folder: str) -> str:
    if name == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from tiny_models import tiny_model, write_tiny_gguf

        path = os.path.join(folder, "tiny.gguf")
        write_tiny_gguf(path, tiny_model(seed=7))
        return path
    if name == "qwen":
        from cortexstream.training.c2c.sharer_asset import qwen_coder_gguf

        return qwen_coder_gguf()  # AssetError saying how to fetch it
    raise SystemExit(f"--models: {name!r} is not one of tiny, qwen")


SYSTEMS = ("cortexstream", "mlx_lm")


def _median_cell(runs: list[dict]) -> dict:
    """The round with the median tokens/s (its other fields kept with it), and every round's tokens/s."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def _markdown(payload: dict) -> str:
    m = payload["machine"]
    lines = ["# Two ranks on one machine: rank 0's relay cost and tokens/s, beside mlx-lm's sharded generation", "",
             f"Machine: {m.get('platform')}, {m.get('cpu')}, {m.get('cpu_count')} cores, MLX {m.get('mlx')}, "
             f"mlx-lm {m.get('mlx_lm')}, BLAS: {m.get('blas')}.", "",
             f"{payload['requests']} greedy requests of {payload['max_tokens']} tokens through each system's "
             "`batch_generate`, one warm-up pass, then one timed pass per round; median of "
             f"{payload['rounds']} round(s), the order of the runs alternating between rounds. Two ranks share this "
             "machine's cores, so 2 ranks here measure what the split costs, not what two machines gain. mlx-lm: "
             "`sharded_load` (tensor parallel) on the same weights, written as an mlx-lm directory by `cortexstream "
             "convert`.", "",
             "Steps, plan encode+send and bytes: the timed batch pass on 2 ranks. TTFT and TPOT: one stream of the "
             "first prompt after the batch (`stream_generate`), ms.", "",
             "| model | system | tokens/s, 1 rank | tokens/s, 2 ranks | 2 ranks / 1 | steps | plan encode+send "
             "ms/step | plan bytes/step | TTFT 1 rank | TTFT 2 ranks | TPOT 1 rank | TPOT 2 ranks |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, cell in payload["models"].items():
        if "skipped" in cell:
            lines.append(f"| {name} | skipped: {cell['skipped']} | | | | | | | | | | |")
            continue
        for system, runs in cell.items():
            one, two = runs["1"], runs["2"]
            relay = (f"{two['steps']} | {two['relay_ms_per_step']:.3f} | {two['plan_bytes_per_step']:.0f}"
                     if "steps" in two else "n/a | n/a | n/a")
            latency = " | ".join(f"{1000 * run[key]:.1f}" if key in run else "n/a"
                                 for key in ("ttft_s", "tpot_s") for run in (one, two))
            lines.append(f"| {name} | {system} | {one['tokens_per_s']:.1f} | {two['tokens_per_s']:.1f} | "
                         f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x | {relay} | {latency} |")
    lines += ["", f"Rerun: `{payload['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()  # OpenBLAS as every benchmark here uses; the ranks inherit the environment
    parser = argparse.ArgumentParser(prog="python -m bench.distributed_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,qwen", help="comma-separated: tiny, qwen (default both)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: cortexstream, mlx_lm")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (median reported)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 requests of 8 tokens, 1 round")
    parser.add_argument("--out", default=os.path.join("bench", "results"))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-system", default="cortexstream", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1 or args.rounds < 1:
        parser.error("--requests, --max-tokens and --rounds must be >= 1")
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems: {unknown or args.systems!r} not among {', '.join(SYSTEMS)}")
    if args.worker:
        if args.worker_system == "mlx_lm":
            return mlx_lm_worker(args.worker, args.requests, args.max_tokens, args.worker_out)
        return worker(args.worker, args.requests, args.max_tokens, args.worker_out)
    command = "python -m bench.distributed_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.models, args.requests, args.max_tokens, args.rounds = "tiny", 2, 8, 1
    from cortexstream.benchmarks.common import show_report, write_results
    from cortexstream.benchmarks.machine import machine
    from cortexstream.benchmarks.serve import convert_to_mlx_lm
    from cortexstream.training.c2c.sharer_asset import AssetError

    payload: dict[str, Any] = {"machine": machine(), "requests": args.requests, "max_tokens": args.max_tokens,
                               "rounds": args.rounds, "command": command.strip(), "models": {}}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            try:
                path = _model_path(name, folder)
            except AssetError as exc:
                payload["models"][name] = {"skipped": str(exc)}
                continue
            sources = {"cortexstream": path}
            if "mlx_lm" in systems:
                sources["mlx_lm"] = os.path.join(folder, f"{name}-mlx")
                convert_to_mlx_lm(path, Path(sources["mlx_lm"]))
            runs: dict[tuple[str, int], list[dict]] = {}
            order = [(system, n) for n in (1, 2) for system in systems]
            for round_index in range(args.rounds):
                for system, n in order if round_index % 2 == 0 else order[::-1]:
                    print(f"[distributed_overhead] {name} {system} {n} rank(s), round {round_index + 1}", flush=True)
                    runs.setdefault((system, n), []).append(
                        _run(system, sources[system], n, args.requests, args.max_tokens, folder, args.timeout))
            payload["models"][name] = {system: {str(n): _median_cell(runs[(system, n)]) for n in (1, 2)}
                                       for system in systems}
    write_results(args.out, RESULT, payload, _markdown(payload))
    return show_report(args.out, RESULT)


if __name__ == "__main__":
    sys.exit(main())
