"""Draft-model speculation scenarios of tests/distributed_rank.py (scenario "draft"; tests/test_distributed_draft.py).

The engine drafts with `draft:model=SOURCE,k=3,adaptive=0` (a fixed k: what is drafted does not depend on measured
step times, so the counts can be compared with one process's). SOURCE is the rank script's fifth argument, else
DRAFT_FILE beside the target model. The scenario runs one greedy stream, then 4 concurrent greedy requests, then 2
requests sampled without a seed (they draft, drawing from each step's seed) beside 2 seeded sampled ones (which
never draft: they bring their own sampler), and reports tokens and the drafted and accepted counts of each part.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cortexstream
from cortexstream.engine.sampling import SamplingParams

SCENARIOS = ("draft",)
DRAFT_FILE = "draft.gguf"  # the draft model's file beside the target model, unless the rank script names one
K = 3
PROMPTS = [[5, 17, 99, 42, 7], [3, 3, 8, 120, 64, 11, 2, 90], [77], list(range(10, 50))]


def source(model_path: str) -> str:
    return sys.argv[5] if len(sys.argv) > 5 else str(Path(model_path).with_name(DRAFT_FILE))


def settings(model_path: str) -> dict:
    return {"kv_tokens": 2048, "max_num_seqs": 4, "speculative": f"draft:model={source(model_path)},k={K},adaptive=0"}


def _counts(engine, before: dict, key: str) -> dict:
    after = engine.stats()
    return {f"{key}_{count}": after[f"spec_{count}_tokens"] - before[f"spec_{count}_tokens"]
            for count in ("drafted", "accepted")}


def _mixed(engine) -> dict:
    """Unseeded sampled requests (drafting) and seeded ones (not drafting) in the same steps."""
    ids = [engine.add_request(PROMPTS[i], SamplingParams(max_tokens=16, temperature=0.7)) for i in (0, 3)]
    ids += [engine.add_request(PROMPTS[i], SamplingParams(max_tokens=16, temperature=0.9, seed=1234 + i))
            for i in (1, 2)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens[out.request_id].append(out.token)
    return {"draft_unseeded": [tokens[rid] for rid in ids[:2]], "draft_seeded": [tokens[rid] for rid in ids[2:]]}


def run(model, tokenizer, engine) -> dict:
    result: dict = {}
    before = engine.stats()
    result["draft_single"] = [r.token for r in cortexstream.stream_generate(model, tokenizer, PROMPTS[1],
                                                                             max_tokens=24, engine=engine)]
    result.update(_counts(engine, before, "draft_single"))
    before = engine.stats()
    out = cortexstream.batch_generate(model, tokenizer, PROMPTS, max_tokens=[20, 12, 16, 9], engine=engine,
                                      return_token_ids=True)
    result["draft_batch"] = out.token_ids
    result.update(_counts(engine, before, "draft_batch"))
    before = engine.stats()
    result.update(_mixed(engine))
    result.update(_counts(engine, before, "draft_sampled"))
    return result
