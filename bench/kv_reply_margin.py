"""Why a KV storage changes how many replies come back empty in `bench serve`'s memory-bound workload
(`python -m bench.kv_reply_margin`): a diagnostic for issue #32, accuracy only.

The memory-bound workload (`serve_workloads.memory_bound_workload`, the sessions `bench serve` sends) is replayed
offline through the public `batch_generate`, greedy, one call per turn with every session's conversation so far,
each storage feeding its own replies back as the benchmark's clients do. Per storage it reports each session's
reply length per turn (in tokens, the end-of-text token counted: a reply of 1 token is an empty text) and the total.
Then, for each session's first turn, the prompt prefilled through `make_prompt_cache` (chunks of 512) gives the
log-probability of end-of-text against the best other token: a margin near zero means that a small change to the
attention output (any storage, or the server's chunking) can flip the greedy reply to empty, and a flipped turn
stays empty for the rest of its conversation (the empty reply is resent as history).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.benchmarks.runner import run_as_script

RESULT = "kv_reply_margin"
CHUNK = 512


def _kv_dtype(storage: str) -> str | None:
    return None if storage == "float32" else storage


def replay(model: Any, tokenizer: Any, sessions: list, storage: str) -> list[list[int]]:
    """Reply lengths [turn][session] of the workload replayed turn by turn on `storage`."""
    import cortexstream

    conversations = [([{"role": "system", "content": s.system}] if s.system else []) for s in sessions]
    lengths = []
    for turn in range(len(sessions[0].turns)):
        for messages, session in zip(conversations, sessions):
            messages.append({"role": "user", "content": session.turns[turn].user_text})
        out = cortexstream.batch_generate(model, tokenizer, [list(m) for m in conversations],
                                          max_tokens=[s.turns[turn].max_tokens for s in sessions],
                                          kv_dtype=_kv_dtype(storage), temp=0.0, return_token_ids=True)
        for messages, text in zip(conversations, out.texts):
            messages.append({"role": "assistant", "content": text})
        lengths.append([len(ids) for ids in out.token_ids])
        print(f"{storage} turn {turn}: {lengths[-1]}", flush=True)
    return lengths


def first_token_margin(model: Any, tokenizer: Any, session: Any, storage: str) -> dict[str, Any]:
    """End-of-text vs the best other token for the first reply of `session`, prefilled on `storage`."""
    import mlx.core as mx

    from cortexstream.engine.prompt import chat_tokens
    from cortexstream.kv.prompt_cache import make_prompt_cache

    ids = chat_tokens(tokenizer, [{"role": "system", "content": session.system},
                                  {"role": "user", "content": session.turns[0].user_text}])
    cache = make_prompt_cache(model, len(ids) + 8, kv_dtype=_kv_dtype(storage))
    for start in range(0, len(ids), CHUNK):
        logits = model(mx.array([ids[start:start + CHUNK]]), cache=cache)
    logprobs = logits[0, -1] - mx.logsumexp(logits[0, -1])
    eos = tokenizer.eos_token_id
    others = mx.where(mx.arange(logprobs.shape[0]) == eos, -mx.inf, logprobs)
    best = int(mx.argmax(others).item())
    eos_lp, best_lp = float(logprobs[eos].item()), float(others[best].item())
    return {"prompt_tokens": len(ids), "eos_logprob": eos_lp, "best_other": tokenizer.decode([best]),
            "best_other_logprob": best_lp, "margin": eos_lp - best_lp}


def report(payload: dict) -> str:
    storages = payload["storages"]
    lines = ["# Empty replies per KV storage in the memory-bound workload (`python -m bench.kv_reply_margin`)", "",
             f"{machine_sentence(payload['machine'])}. Model {payload['model']}; the `bench serve` memory_bound "
             f"workload ({payload['sessions']} sessions, seed {payload['seed']}, {payload['history_tokens']}-token "
             "histories) replayed offline with `batch_generate`, greedy, one call per turn, each storage feeding its "
             "own replies back. Accuracy only.", "",
             "## Reply lengths (tokens, end-of-text counted: 1 = empty)", "",
             "| storage | turn | " + " | ".join(f"s{i}" for i in range(payload["sessions"])) + " |",
             "|---|---:|" + "---:|" * payload["sessions"]]
    for storage in storages:
        for turn, row in enumerate(payload["replay"][storage]):
            lines.append(f"| {storage} | {turn} | " + " | ".join(str(n) for n in row) + " |")
    lines += ["", "| storage | empty replies | reply tokens |", "|---|---:|---:|"]
    for storage in storages:
        rows = payload["replay"][storage]
        lines.append(f"| {storage} | {sum(n <= 1 for r in rows for n in r)} | {sum(map(sum, rows))} |")
    lines += ["", "## First reply token: log p(end-of-text) - log p(best other token)", "",
              "Positive: greedy decoding answers empty. Prompt prefilled in chunks of 512.", "",
              "| session | prompt tokens | " + " | ".join(storages) + " |", "|---:|---:|" + "---:|" * len(storages)]
    for i, cells in enumerate(payload["margins"]):
        lines.append(f"| s{i} | {cells[storages[0]]['prompt_tokens']} | "
                     + " | ".join(f"{cells[s]['margin']:+.2f}" for s in storages) + " |")
    lines += ["", f"Rerun: `{payload['command']}` ({payload['elapsed_s'] / 60:.1f} min)", ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model source (default: SmolLM2, as bench serve)")
    parser.add_argument("--storages", default="float32;int4", help="';'-separated KV storages (kv_dtype spellings)")
    parser.add_argument("--sessions", type=int, default=8, help="sessions of the workload (bench serve's --sessions)")
    parser.add_argument("--history-tokens", type=int, default=1000, help="bench serve's --history-tokens")
    parser.add_argument("--seed", type=int, default=0, help="bench serve's --seed")
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    import cortexstream
    from cortexstream.benchmarks.serve_workloads import memory_bound_workload
    from cortexstream.kv.kv_dtype import parse_kv_dtype

    storages = [s.strip() for s in args.storages.split(";") if s.strip()]
    for storage in storages:
        if storage != "float32":
            parse_kv_dtype(storage, model_dtype="float32")  # a bad spelling fails before the model loads
    start = time.perf_counter()
    model, tokenizer = cortexstream.load(args.model)
    sessions = memory_bound_workload(tokenizer, args.seed, False, args.sessions, args.history_tokens).sessions
    payload: dict[str, Any] = dict(benchmark=RESULT, machine=machine(), model=args.model, storages=storages,
                                   sessions=args.sessions, seed=args.seed, history_tokens=args.history_tokens)
    payload["margins"] = [{s: first_token_margin(model, tokenizer, session, s) for s in storages}
                          for session in sessions]
    payload["replay"] = {s: replay(model, tokenizer, sessions, s) for s in storages}
    payload["elapsed_s"] = time.perf_counter() - start
    payload["command"] = ("python -m bench.kv_reply_margin " + shlex.join(sys.argv[1:])).strip()
    write_results(args.out, RESULT, payload, report(payload))
    print(report(payload))
    return 0


def main(argv: list[str] | None = None) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()
    return run_as_script(__doc__, add_arguments, run_from_args, argv, prog="python -m bench.kv_reply_margin")


if __name__ == "__main__":
    raise SystemExit(main())
