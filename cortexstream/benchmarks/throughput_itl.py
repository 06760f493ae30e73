"""Inter-token latency of running streams while a long prompt is admitted (`bench throughput`, part "itl").

`streams` requests decode steadily; then a `admit_tokens`-token prompt arrives. Each running stream's tokens are
timestamped when `Engine.step()` hands them out (what a client of the engine sees), and every interval between
two consecutive tokens of a stream is classed as before the admission, in the admission window (overlapping the
time from the long prompt's arrival to its first token) or after it. The engine is stepped directly in this
thread rather than through `ThreadedEngine`, so no consumer thread competes for the 2 cores and the timestamps
carry no queue hand-off delay.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from cortexstream.benchmarks.common import percentile
from cortexstream.benchmarks.throughput_prompts import text_windows

ITL_TARGET = 3.0  # p99 of running streams' ITL during the admission <= 3x their median (steady decode)
WARM_TOKENS = 16  # tokens every running stream decodes before the long prompt arrives
AFTER_TOKENS = 16  # steps measured after the long prompt's first token


def _stats(intervals: list[float]) -> dict[str, float | int]:
    if not intervals:
        return {"count": 0, "median_s": float("nan"), "p99_s": float("nan"), "max_s": float("nan")}
    return {"count": len(intervals), "median_s": statistics.median(intervals),
            "p99_s": percentile(intervals, 99), "max_s": max(intervals)}


def _one_round(model: Any, tokenizer: Any, streams: int, stream_prompt_tokens: int,
               admit_tokens: int, ranks: Any = None) -> dict[str, Any]:
    from cortexstream.engine.engine import Engine
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import ArenaConfig

    texts = text_windows(tokenizer, streams + 1, max(stream_prompt_tokens, admit_tokens))
    running_prompts = [t[:stream_prompt_tokens] for t in texts[:streams]]
    long_prompt = texts[streams][:admit_tokens]
    budget = WARM_TOKENS + AFTER_TOKENS + admit_tokens  # more than the steps the window can take; aborted below
    # Preallocated, so that no arena growth lands among the inter-token latencies measured.
    arena = KVArena(ArenaConfig.for_model(model, num_tokens=streams * (stream_prompt_tokens + budget) + admit_tokens
                                          + 256), preallocate=True)
    engine = Engine(model, tokenizer, arena=arena, max_num_seqs=streams + 1, prefix_caching=False)
    if ranks is not None:  # every step runs on every rank (throughput_ranks.py)
        ranks.attach(engine)
    ids = [engine.add_request(p, max_tokens=budget) for p in running_prompts]
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    long_id: str | None = None
    admitted_at = first_long_token_at = None
    after_steps = 0
    while engine.has_unfinished and after_steps < AFTER_TOKENS:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.token is None:
                continue
            if out.request_id == long_id and first_long_token_at is None:
                first_long_token_at = now
            elif out.request_id in stamps:
                stamps[out.request_id].append(now)
        if long_id is None and all(len(s) >= WARM_TOKENS for s in stamps.values()):
            long_id = engine.add_request(long_prompt, max_tokens=AFTER_TOKENS)
            admitted_at = time.perf_counter()
        elif first_long_token_at is not None:
            after_steps += 1
    for request_id in [*ids, long_id]:
        if request_id is not None:
            engine.abort(request_id)
    if ranks is not None:
        ranks.detach(engine)  # the other ranks free its arena
    engine.close()
    if admitted_at is None or first_long_token_at is None:
        raise RuntimeError("the admitted prompt produced no token (running streams ended before it?)")
    before, window, after = [], [], []
    for times in stamps.values():
        for start, end in zip(times, times[1:]):
            if end <= admitted_at:
                before.append(end - start)
            elif start < first_long_token_at:
                window.append(end - start)
            else:
                after.append(end - start)
    return {"before": before, "window": window, "after": after,
            "admitted_ttft_s": first_long_token_at - admitted_at}


def measure_itl(model: Any, tokenizer: Any, streams: int = 8, stream_prompt_tokens: int = 128,
                admit_tokens: int = 2048, rounds: int = 3, ranks: Any = None) -> dict[str, Any]:
    """Pool the intervals of `rounds` fresh engines (one round gives too few window intervals for a p99). With
    `ranks` (rank 0's DistributedSession) each engine is attached to every rank for its round."""
    pooled: dict[str, list[float]] = {"before": [], "window": [], "after": []}
    admitted_ttfts = []
    for _ in range(rounds):
        one = _one_round(model, tokenizer, streams, stream_prompt_tokens, admit_tokens, ranks)
        for key in pooled:
            pooled[key] += one[key]
        admitted_ttfts.append(one["admitted_ttft_s"])
    steady = _stats(pooled["before"])
    window = _stats(pooled["window"])
    overall = _stats(pooled["before"] + pooled["window"] + pooled["after"])
    ratio = window["p99_s"] / steady["median_s"] if steady["count"] and window["count"] else float("nan")
    return {
        "streams": streams,
        "stream_prompt_tokens": stream_prompt_tokens,
        "admit_tokens": admit_tokens,
        "rounds": rounds,
        "warm_tokens": WARM_TOKENS,
        "after_tokens": AFTER_TOKENS,
        "steady": steady,
        "window": window,
        "after": _stats(pooled["after"]),
        "overall": overall,
        "window_p99_over_steady_median": ratio,
        "overall_p99_over_overall_median": overall["p99_s"] / overall["median_s"] if overall["count"] else None,
        "admitted_ttft_s": admitted_ttfts,
        "target": ITL_TARGET,
        "meets_target": ratio <= ITL_TARGET,
    }
