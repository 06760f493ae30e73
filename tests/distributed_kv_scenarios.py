"""The KV scenarios of a distributed test run (tests/distributed_rank.py runs them on rank 0, or in one process
for the reference): per-head KV policies that evict, the prefix cache, and `n > 1` forked from one prompt.

- "policies": every policy that selects per KV head (`POLICIES`), one greedy stream and a batch of three prompts
  each, longer than the budget so the policy evicts; with the tokens evicted (the arena's `evicted_tokens`);
- "kvzip": KVzip (`KVZIP`) the same way, its prompts reconstructed in 16-token chunks (`StepPlan.score` items) before
  it evicts; with the reconstruction chunks the plans carried;
- "merging": the policies that merge per KV head (`MERGING`: mean pooling, token merging) the same way; with the
  tokens merged away (the arena's `compressed_tokens`);
- "prefix": a long prompt twice, then two prompts sharing a 64-token prefix in one batch; with the prompt tokens
  each request was served from the prefix cache (its `num_cached_prefix`, as the server reports it);
- "fork": `Engine.fork` (the server's `n`), three seeded completions and three unseeded ones of a prompt whose last
  block is partly filled (each child copies it on write); with the copy-on-write pairs the plans carried.

The engine is shared by every scenario of a run and prefills with a fixed budget while others decode
(`FIXED_CHUNKS`), so where a policy evicts does not depend on measured step times and one process chunks as rank 0.
"""

from __future__ import annotations

from typing import Any, Callable

import cortexstream
from cortexstream.engine.sampling import SamplingParams

SCENARIOS = ("policies", "kvzip", "merging", "prefix", "fork")
FIXED_CHUNKS = {"prefill_tokens_while_decoding": 16}
POLICIES = ("h2o:budget=24,sinks=2", "expected:budget=24,sinks=2,recent=4", "d2o:budget=24,sinks=2,threshold=0",
            "snapkv:budget=24,sinks=2,window=8")
KVZIP = "kvzip:budget=24,sinks=2,chunk=16"
MERGING = ("meanpool:window=4,sinks=2,recent=8", "tome:window=8,sinks=2,recent=8,slots=2")
POLICY_PROMPTS = [list(range(10, 60)), [5, 17, 99, 42, 7] * 9, [(7 * j) % 200 + 3 for j in range(37)]]
LONG_PROMPT = [(11 * j) % 250 + 3 for j in range(80)]  # 5 full blocks of 16
SHARED_PREFIX = [(13 * j) % 240 + 5 for j in range(64)]
FORK_PROMPT = [(17 * j) % 230 + 4 for j in range(41)]  # the last of its 3 blocks holds 9 tokens


def policies(model: Any, tokenizer: Any, engine: Any, names: tuple[str, ...] = POLICIES,
             counter: str = "evicted_tokens") -> dict:
    """Each policy of `names`: one greedy stream and a batch, and how much the engine's `counter` grew meanwhile."""
    out = {}
    for policy in names:
        before = engine.stats()[counter]
        single = [r.token for r in cortexstream.stream_generate(model, tokenizer, POLICY_PROMPTS[0], max_tokens=16,
                                                                 engine=engine, kv_policy=policy)]
        batch = cortexstream.batch_generate(model, tokenizer, POLICY_PROMPTS, max_tokens=[16, 12, 20], engine=engine,
                                            kv_policy=policy, return_token_ids=True)
        out[policy] = {"single": single, "batch": batch.token_ids, "evicted": engine.stats()[counter] - before}
    return {"policies": out}


def kvzip(model: Any, tokenizer: Any, engine: Any, score_items: Callable[[], int]) -> dict:
    """`score_items()`: the reconstruction chunks the engine's plans carried so far."""
    before = score_items()
    out = policies(model, tokenizer, engine, (KVZIP,))
    return {"kvzip": out["policies"][KVZIP], "kvzip_score_items": score_items() - before}


def run_requests(engine: Any, add: Callable[[], list[str]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Queue requests with `add` (returns their ids), step the engine until they end: each one's tokens and the
    prompt tokens it was served from the prefix cache (read from the engine's snapshots between steps)."""
    ids = add()
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens.setdefault(out.request_id, []).append(out.token)
        for seq in engine.snapshot(blocks=False).running:
            cached[seq.request_id] = max(cached.get(seq.request_id, 0), seq.num_cached_prefix)
    return tokens, cached


def prefix(engine: Any) -> dict:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    runs = []
    for prompts in ([LONG_PROMPT], [LONG_PROMPT], [SHARED_PREFIX + [9, 8, 7], SHARED_PREFIX + [100, 101]]):
        tokens, cached = run_requests(engine, lambda: [engine.add_request(p, greedy) for p in prompts])
        runs.append([[tokens[rid], cached.get(rid, 0)] for rid in tokens])
    return {"prefix": runs, "prefix_hit_blocks": engine.stats()["prefix_hit_blocks"]}


def fork(engine: Any, copies: Callable[[], int]) -> dict:
    """`copies()`: the copy-on-write pairs the engine's plans carried so far."""
    before = copies()

    def forked(sampling: SamplingParams, ids: list[str]) -> Callable[[], list[str]]:
        def add() -> list[str]:
            engine.fork(FORK_PROMPT, sampling, ids)
            return ids
        return add

    seeded_ids, unseeded_ids = ["fork-1", "fork-2", "fork-3"], ["fork-4", "fork-5", "fork-6"]
    seeded, _ = run_requests(engine, forked(SamplingParams(max_tokens=12, temperature=0.9, seed=21), seeded_ids))
    unseeded, _ = run_requests(engine, forked(SamplingParams(max_tokens=12, temperature=0.9), unseeded_ids))
    return {"fork": [seeded[rid] for rid in seeded_ids], "fork_unseeded": [unseeded[rid] for rid in unseeded_ids],
            "fork_copies": copies() - before}


def run(model: Any, tokenizer: Any, engine: Any, scenario: str, copies: Callable[[], int],
        score_items: Callable[[], int]) -> dict:
    """`copies()`, `score_items()`: the copy-on-write pairs and reconstruction chunks the engine's plans carried."""
    if scenario == "policies":
        return policies(model, tokenizer, engine)
    if scenario == "kvzip":
        return kvzip(model, tokenizer, engine, score_items)
    if scenario == "merging":
        return {"merging": policies(model, tokenizer, engine, MERGING, "compressed_tokens")["policies"]}
    if scenario == "prefix":
        return prefix(engine)
    if scenario == "fork":
        return fork(engine, copies)
    raise SystemExit(f"unknown scenario {scenario!r}")
