"""Decode speed per KV storage for `bench kv-dtype`: engine decode steps at a batch size and a number of keys.

For one (batch, keys) setting, one `Engine` per storage, configured as `batch_generate` configures its own (prompts
first: no decoding while a prompt waits), gets `batch` different real-text prompts of `keys` tokens
(`common.prompt_token_lists`) and is stepped until every request has its first token (the prompts are in the arena)
plus `warmup` decode steps. Then, each round, every engine runs `steps` decode steps, the storages taking turns in
an order that rotates by one each round; a segment's time ends after `mx.synchronize()`, so work an engine left in
flight is counted in its own segment and never runs into the next engine's. Tokens per second = tokens the steps
returned / segment time; the median over rounds is reported. Prefill runs once per storage and setting (it is not
what is measured), and the keys grow by the decoded tokens during the rounds (recorded as `keys_at_end`).

The tokenizer is wrapped so that no token ends a request (`NoEosTokenizer`), and each request may generate, beyond
what the timed steps need, as many tokens as there are prefill steps: a request whose prompt is in decodes while
the later prompts are prefilled (at 8 x 4096 keys, 64 steps of 512 prompt tokens), so with no such margin the first
requests reached their limit during the timed steps and a "batch of 8" decoded 6. After the prefill the whole batch
must be running, or the measurement stops with an error: every timed step decodes the whole batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import mlx.core as mx

from cortexstream.benchmarks.common import NoEosTokenizer, prompt_token_lists, release_engines
from cortexstream.benchmarks.kv_dtype_measure import Storage
from cortexstream.engine.engine import Engine
from cortexstream.engine.sampling import SamplingParams

PREFILL_STEP = 512  # prompt tokens per engine step while the prompts go in


def prefilled_engine(model: Any, tokenizer: Any, prompts: list[list[int]], storage: Storage, max_tokens: int,
                      warmup: int, kv_policy: Any = None) -> Engine:
    batch = len(prompts)
    margin = -(-sum(len(p) for p in prompts) // PREFILL_STEP) + batch  # tokens decoded while later prompts prefill
    max_tokens += margin
    engine = Engine(model, NoEosTokenizer(tokenizer), kv_tokens=batch * (len(prompts[0]) + max_tokens + 32),
                    max_num_seqs=batch, prefill_step_size=PREFILL_STEP, prefill_tokens_while_decoding=None,
                    kv_dtype=storage.text, kv_group_size=storage.group_size)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    waiting = {engine.add_request(p, sampling, kv_policy=kv_policy) for p in prompts}
    while waiting:
        waiting -= {out.request_id for out in engine.step() if out.token is not None}
    for _ in range(warmup):
        engine.step()
    mx.synchronize()
    stats = engine.stats()
    if stats["running"] != batch:
        raise RuntimeError(f"decode benchmark: {stats['running']} of {batch} requests running after the prefill "
                           f"({stats['preemptions']} preemptions, {stats['waiting']} waiting): the timed steps would "
                           "not decode the whole batch")
    return engine


def _segment(engine: Engine, steps: int) -> tuple[int, float]:
    tic = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(out.token is not None for out in engine.step())
    mx.synchronize()
    return tokens, time.perf_counter() - tic


def decode_rows(model: Any, tokenizer: Any, storages: list[Storage], batch: int, keys: int, *, steps: int,
                rounds: int, warmup: int = 8, policy: tuple[str, Any] = ("full", None),
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per storage: decode tokens/s of each round and their median, at `batch` sequences of `keys` keys
    (prompt tokens). `policy` (label, KV policy or None): every request evicts under it, so its keys stay near
    the budget while it decodes."""
    label, kv_policy = policy
    prompts = prompt_token_lists(tokenizer, batch, keys)
    max_tokens = warmup + rounds * steps + 16  # a few tokens more than the steps need: no request ends early
    engines: dict[str, Engine] = {}
    tps: dict[str, list[float]] = {s.text: [] for s in storages}
    tokens: dict[str, int] = {s.text: 0 for s in storages}
    try:
        for storage in storages:
            tic = time.perf_counter()
            engines[storage.text] = prefilled_engine(model, tokenizer, prompts, storage, max_tokens, warmup,
                                                     kv_policy)
            log(f"decode batch={batch} keys={keys} {storage.text} {label}: prompts in "
                f"({time.perf_counter() - tic:.0f}s)")
        names = [s.text for s in storages]
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                count, seconds = _segment(engines[name], steps)
                tokens[name] += count
                tps[name].append(count / seconds)
    finally:
        release_engines(engines)
    rows = []
    for storage in storages:
        rows.append({"batch": batch, "keys": keys, "storage": storage.text, "policy": label,
                     "spec": kv_policy.describe() if kv_policy is not None else "full",
                     "group_size": storage.group_size,
                     "steps": steps, "rounds": rounds, "warmup_steps": warmup, "tokens": tokens[storage.text],
                     "expected_tokens": batch * steps * rounds, "keys_at_end": keys + warmup + rounds * steps,
                     "tps": tps[storage.text], "tps_median": statistics.median(tps[storage.text])})
        log(f"decode batch={batch} keys={keys} {storage.text} {label}: {rows[-1]['tps_median']:.1f} tok/s (median of "
            f"{rounds})")
    return rows


__all__ = ["decode_rows", "prefilled_engine"]
