"""What a KV policy adds to a prompt's prefill: `python -m bench.compression_cost`.

Time to the first token of one request (`cortexstream.generate`'s engine path: `Engine.add_request`, steps until the
first token) on a wiki prompt of each length, with the full cache and each policy at a 20 % budget, the policies'
order rotating each round, the median of `--rounds`. The ratio to the full cache is the policy's cost on prefill:
SnapKV records the window's attention and compresses once; ExpectedAttention keeps query statistics and scores every
key when over budget; H2O and D2O record attention for every query and evict after every pass; KVzip (query-agnostic)
runs its reconstruction pass over the prompt once it is complete, before the first token; AdaKV is SnapKV's votes
with a shared budget per layer. Issue #34's target for a query-agnostic policy's extra pass: <= 1.2x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.benchmarks.runner import run_as_script

POLICIES = ("full", "h2o:budget=0.2", "snapkv:budget=0.2", "expected:budget=0.2", "d2o:budget=0.2",
            "kvzip:budget=0.2", "adakv:budget=0.2")


def ttft(model: Any, tokenizer: Any, prompt: list[int], policy: str, chunk: int) -> float:
    from cortexstream.engine.engine import Engine

    engine = Engine(model, tokenizer, kv_tokens=len(prompt) + 64, prefill_step_size=chunk, max_num_seqs=1)
    try:
        tic = time.perf_counter()
        engine.add_request(prompt, max_tokens=2, kv_policy=policy)
        while engine.has_unfinished:
            if any(out.token is not None for out in engine.step()):
                return time.perf_counter() - tic
        raise RuntimeError("no token")
    finally:
        engine.close()


def markdown(data: dict[str, Any]) -> str:
    out = ["# Prefill cost of KV policies (`python -m bench.compression_cost`)", "",
           f"Machine: {machine_sentence(data['machine'])}. SmolLM2-135M, prefill chunk {data['chunk']}, "
           f"median of {data['rounds']} rounds (policies' order rotating), time to the first token of one request "
           "through the engine.", "",
           "| prompt tokens | policy | TTFT s (median) | rounds | vs full |", "|---:|---|---:|---|---:|"]
    for r in data["rows"]:
        out.append(f"| {r['tokens']} | {r['policy']} | {r['median']:.2f} | "
                   f"{', '.join(f'{t:.2f}' for t in r['seconds'])} | {r['ratio']:.2f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tokens", default="2048,4096")
        parser.add_argument("--rounds", type=int, default=3)
        parser.add_argument("--chunk", type=int, default=512)
        parser.add_argument("--policies", default=";".join(POLICIES),
                            help="semicolon-separated policy strings (the first is the reference; give 'full' first)")
        parser.add_argument("--out", default="bench/results")

    def run(args: argparse.Namespace) -> int:
        from cortexstream.backend import enable_linux_cpu_tuning

        enable_linux_cpu_tuning()
        from cortexstream.evaluation.wiki_corpus import wiki_text
        from cortexstream.models.loader import load

        from cortexstream.policies import parse_policy

        policies = tuple(p.strip() for p in args.policies.split(";") if p.strip())
        if not policies or policies[0] != "full":
            raise SystemExit(f"--policies: {args.policies!r} must start with 'full' (the reference)")
        for spec in policies:
            parse_policy(spec)  # a bad string fails here, before the model loads
        model, tokenizer = load(None)
        ids = list(tokenizer.encode(wiki_text()[0]))
        rows = []
        for tokens in (int(t) for t in args.tokens.split(",")):
            prompt = ids[:tokens]
            times: dict[str, list[float]] = {p: [] for p in policies}
            ttft(model, tokenizer, prompt[:256], "full", args.chunk)  # warm-up
            for r in range(args.rounds):
                order = policies[r % len(policies):] + policies[:r % len(policies)]
                for policy in order:
                    times[policy].append(ttft(model, tokenizer, prompt, policy, args.chunk))
                    print(f"[compression_cost] {tokens} {policy}: {times[policy][-1]:.2f}s", flush=True)
            full = statistics.median(times["full"])
            rows += [{"tokens": tokens, "policy": p, "seconds": t, "median": statistics.median(t),
                      "ratio": statistics.median(t) / full} for p, t in times.items()]
        data = {"machine": machine(), "chunk": args.chunk, "rounds": args.rounds, "rows": rows}
        write_results(args.out, "compression_cost", data, markdown(data))
        print(markdown(data))
        return 0

    return run_as_script(__doc__, add, run, argv, "python -m bench.compression_cost")


if __name__ == "__main__":
    raise SystemExit(main())
