"""One rank of a distributed test run (tests/test_distributed.py starts two of these, or mlx.launch does).

    python distributed_rank.py MODEL.gguf SCENARIOS OUT.json [TIMEOUT [IDLE_SECONDS]]

Every rank loads MODEL and joins the session; rank 0 runs each comma-separated scenario and writes what it
generated to OUT.json, every other rank writes the tokens it sampled per request to OUT.json.rank<N>. Scenarios:
"single" (one greedy stream), "batch" (concurrent greedy prompts through batch_generate), "sampled" (seeded and
unseeded sampled requests), "streaming" (a position-based KV policy), "idle" (rank 0 generates, waits
IDLE_SECONDS without stepping, generates again), "long" (generates until a rank is killed; OUT.json.started
appears after the first tokens). On a real model (Qwen2.5-Coder-0.5B), with prompts of Wikipedia text: "real"
(one greedy stream and 8 concurrent requests), "real_long" (one prompt beyond 4k tokens), "real_streaming" (a
position-based policy that evicts), "real_h2o" (the 8 requests under a per-head H2O budget that evicts, prompt chunks
pinned so that one process evicts where rank 0 does), "real_int8" (the same 8 requests on an int8 KV arena). "soak" (tiny model):
30 greedy requests of mixed lengths on a small arena that forces preemption, every seventh aborted after 5
tokens; rank 0 also writes every rank's BlockLedger digest. "policies", "kvzip", "merging", "prefix", "fork":
per-head KV policies (selecting, reconstructing, merging), the prefix cache and n > 1
(tests/distributed_kv_scenarios.py). "ngram": greedy requests with repetitive prompts under prompt-lookup
speculation, with a fixed k and the default adaptive k (tokens, and the drafted and accepted counts). "draft":
draft-model speculation (tests/distributed_draft_scenarios.py; the draft model's source is the fifth argument, else
draft.gguf beside MODEL). "local" runs
single and
batch in one process without ranks, "local:SCENARIOS" those scenarios: the reference. Rank 0 also reports its
weights' bytes and its arena's KV bytes per token; every other rank writes its weights' bytes and how many drafted
tokens its runner accepted to OUT.json.rank<N>.footprint.
"""

from __future__ import annotations

import json
import sys
import time

import cortexstream
import distributed_draft_scenarios as draft_scenarios
import distributed_kv_scenarios as kv_scenarios
from cortexstream.distributed import DistributedSession
from cortexstream.engine.engine import Engine

PROMPTS = [[5, 17, 99, 42, 7], [3, 3, 8, 120, 64, 11, 2, 90], [77], list(range(10, 50))]
REAL_TOKENS = 16  # tokens generated per request on the real model (bounded: a CPU test)
LONG_PROMPT = 4200  # tokens of the real model's long prompt


def wiki_prompts(tokenizer) -> tuple[list[list[int]], list[int]]:
    """8 short prompts (20 to 62 tokens) from different places of the Wikipedia text, and one of LONG_PROMPT."""
    from cortexstream.evaluation.wiki_corpus import wiki_text

    tokens = tokenizer.encode(wiki_text()[0][:200_000])
    short = [tokens[1000 * i: 1000 * i + 20 + 6 * i] for i in range(8)]
    return short, tokens[20_000: 20_000 + LONG_PROMPT]


# Repetitive prompts, so that prompt lookup finds matches; the first form drafts k at every match (acceptance does
# not depend on the steps' timings), the second is the default (k adapted to acceptance and measured step costs).
NGRAM_PROMPTS = [[5, 17, 99, 42] * 6, [3, 8, 120, 64, 11] * 5, list(range(10, 30)) * 2, [77, 78] * 8]
NGRAM_FORMS = {"ngram_fixed": "ngram:k=4,n=3,adaptive=0", "ngram": "ngram:k=4,n=3",
               "ngram_sampled": "ngram:k=4,n=3,adaptive=0"}  # the last one sampled without a seed


def ngram(model, tokenizer, engine) -> dict:
    """The repetitive prompts under each prompt-lookup form (greedy, then sampled without a seed): tokens, and the tokens
    drafted and accepted."""
    result = {}
    for key, form in NGRAM_FORMS.items():
        before = engine.stats()
        sampling = {"temperature": 0.3} if key == "ngram_sampled" else {}
        out = cortexstream.batch_generate(model, tokenizer, NGRAM_PROMPTS, max_tokens=24, engine=engine,
                                          speculative=form, return_token_ids=True, **sampling)
        after = engine.stats()
        result[key] = out.token_ids
        for count in ("drafted", "accepted"):
            name = f"spec_{count}_tokens"
            result[f"{key}_{count}"] = after[name] - before[name]
    return result


SOAK_ENGINE = {"kv_tokens": 320, "max_num_seqs": 6}  # 20 blocks of 16 for up to 6 requests of up to ~130 tokens


def soak(model, tokenizer, engine) -> dict:
    """30 greedy requests through the engine's own loop; ids 3, 10, 17, 24 are aborted after their 5th token."""
    from cortexstream.engine.sampling import SamplingParams

    ids, tokens = [], {}
    for i in range(30):
        prompt = [(7 * i + 13 * j) % 200 + 3 for j in range(3 + (i * 37) % 80)]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=4 + (i * 11) % 45, temperature=0.0)))
        tokens[ids[-1]] = []
    aborted = {ids[i] for i in range(3, 30, 7)}
    finished: dict[str, str] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens[out.request_id].append(out.token)
            if out.finished:
                finished[out.request_id] = out.finish_reason.value
            elif out.request_id in aborted and len(tokens[out.request_id]) == 5:
                engine.abort(out.request_id)
    return {"soak": [tokens[rid] for rid in ids], "soak_finish": [finished.get(rid) for rid in ids],
            "soak_preemptions": engine.stats()["preemptions"]}


def engine_settings(scenarios: str) -> dict:
    """The engine of a run: the real-model scenarios need room for 8 requests and the long prompt."""
    if scenarios in draft_scenarios.SCENARIOS:
        return draft_scenarios.settings(sys.argv[1])
    if scenarios == "soak":
        return SOAK_ENGINE
    if any(name in kv_scenarios.SCENARIOS for name in scenarios.split(",")):
        return {"kv_tokens": 2048, "max_num_seqs": 4, **kv_scenarios.FIXED_CHUNKS}
    if "real" not in scenarios:
        return {"kv_tokens": 2048, "max_num_seqs": 4}
    pinned = kv_scenarios.FIXED_CHUNKS if "h2o" in scenarios else {}
    return {"kv_tokens": LONG_PROMPT + 2048, "max_num_seqs": 8, "kv_dtype": "int8" if "int8" in scenarios else None,
            **pinned}


def real(model, tokenizer, engine_for, scenario: str) -> dict:
    short, long = wiki_prompts(tokenizer)
    engine = engine_for(8)
    if scenario == "real":
        single = [r.token for r in cortexstream.stream_generate(model, tokenizer, short[0], max_tokens=REAL_TOKENS,
                                                                 engine=engine)]
        out = cortexstream.batch_generate(model, tokenizer, short, max_tokens=REAL_TOKENS, engine=engine,
                                          return_token_ids=True)
        return {"real_single": single, "real_batch": out.token_ids}
    if scenario == "real_long":
        out = cortexstream.batch_generate(model, tokenizer, [long], max_tokens=8, engine=engine,
                                          return_token_ids=True)
        return {"real_long": out.token_ids[0], "real_long_prompt": len(long)}
    if scenario == "real_streaming":
        out = cortexstream.batch_generate(model, tokenizer, short[4:], max_tokens=REAL_TOKENS * 2, engine=engine,
                                          kv_policy="streaming:sinks=4,window=32", return_token_ids=True)
        return {"real_streaming": out.token_ids}
    if scenario == "real_h2o":
        out = cortexstream.batch_generate(model, tokenizer, short, max_tokens=REAL_TOKENS * 2, engine=engine,
                                          kv_policy="h2o:budget=32,sinks=4", return_token_ids=True)
        return {"real_h2o": out.token_ids, "real_h2o_evicted": engine.stats()["evicted_tokens"]}
    if scenario == "real_int8":
        out = cortexstream.batch_generate(model, tokenizer, short, max_tokens=REAL_TOKENS, engine=engine,
                                          return_token_ids=True)
        return {"real_int8": out.token_ids}
    raise SystemExit(f"unknown scenario {scenario!r}")


def param_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def footprint(model, engine) -> dict:
    return {"param_bytes": param_bytes(model), "kv_bytes_per_token": engine.arena.config.bytes_per_token}


def run(model, tokenizer, engine_for, scenario: str, copies=lambda: 0, score_items=lambda: 0) -> dict:
    """`copies()`, `score_items()`: the copy-on-write pairs and reconstruction chunks the engine's plans carried so
    far (for "fork" and "kvzip")."""
    if scenario in kv_scenarios.SCENARIOS:
        return kv_scenarios.run(model, tokenizer, engine_for(4), scenario, copies, score_items)
    if scenario.startswith("real"):
        return real(model, tokenizer, engine_for, scenario)
    if scenario == "soak":
        return soak(model, tokenizer, engine_for(SOAK_ENGINE["max_num_seqs"]))
    if scenario == "single":
        engine = engine_for(1)
        tokens = [r.token for r in cortexstream.stream_generate(model, tokenizer, PROMPTS[1], max_tokens=24,
                                                                 engine=engine)]
        return {"single": tokens}
    if scenario == "batch":
        engine = engine_for(4)
        out = cortexstream.batch_generate(model, tokenizer, PROMPTS, max_tokens=[20, 12, 16, 9], engine=engine,
                                          return_token_ids=True)
        return {"batch": out.token_ids}
    if scenario == "sampled":
        engine = engine_for(4)
        seeded = cortexstream.batch_generate(model, tokenizer, PROMPTS[:2], max_tokens=16, engine=engine,
                                             return_token_ids=True, temperature=0.9, seed=1234)
        unseeded = cortexstream.batch_generate(model, tokenizer, PROMPTS[2:], max_tokens=16, engine=engine,
                                               return_token_ids=True, temperature=0.9)
        return {"seeded": seeded.token_ids, "unseeded": unseeded.token_ids}
    if scenario == "streaming":
        engine = engine_for(2)
        out = cortexstream.batch_generate(model, tokenizer, PROMPTS[2:], max_tokens=40, engine=engine,
                                          kv_policy="streaming:sinks=4,window=16", return_token_ids=True)
        return {"streaming": out.token_ids}
    if scenario == "ngram":
        return ngram(model, tokenizer, engine_for(4))
    if scenario in draft_scenarios.SCENARIOS:
        return draft_scenarios.run(model, tokenizer, engine_for(4))
    if scenario == "grammar":  # output constrained to JSON: every rank's grammar masks the same tokens
        engine = engine_for(2)
        out = cortexstream.batch_generate(model, tokenizer, PROMPTS[:2], max_tokens=24, engine=engine,
                                          response_format={"type": "json_object"}, return_token_ids=True)
        return {"grammar": out.token_ids, "grammar_texts": out.texts}
    if scenario == "idle":
        engine = engine_for(1)
        first = [r.token for r in cortexstream.stream_generate(model, tokenizer, PROMPTS[0], max_tokens=4,
                                                                engine=engine)]
        time.sleep(float(sys.argv[5]) if len(sys.argv) > 5 else 3.0)  # heartbeats keep the other rank waiting
        second = [r.token for r in cortexstream.stream_generate(model, tokenizer, PROMPTS[0], max_tokens=4,
                                                                 engine=engine)]
        return {"idle": [first, second]}
    if scenario == "long":  # generates until a rank is killed; a marker file says the first tokens came
        engine = engine_for(1)
        for i, response in enumerate(cortexstream.stream_generate(model, tokenizer, PROMPTS[3], max_tokens=100000,
                                                                   engine=engine)):
            if i == 3:
                open(sys.argv[3] + ".started", "w").close()
        return {}
    raise SystemExit(f"unknown scenario {scenario!r}")


def main() -> int:
    path, scenario, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 20.0
    model, tokenizer = cortexstream.load(path)
    if scenario.startswith("local"):  # one process, no ranks: the reference output
        names = scenario.split(":", 1)[1] if ":" in scenario else "single,batch"
        settings = engine_settings(names)
        result, engines, plans = {}, [], []
        for name in names.split(","):
            engines.append(Engine(model, tokenizer, **settings))
            engines[-1].plan_listener = plans.append
            result.update(run(model, tokenizer, lambda n: engines[-1], name,
                              lambda: sum(len(plan.copies) for plan in plans),
                              lambda: sum(len(plan.score) for plan in plans)))
        result.update(footprint(model, engines[-1]))
        json.dump(result, open(out_path, "w"))
        return 0
    with DistributedSession.start(model, tokenizer, timeout=timeout) as ranks:
        if not ranks.is_leader:
            sampled: dict[str, list] = {}
            accepted = [0]

            def record(result) -> None:
                for s in result.sampled:
                    sampled.setdefault(s.request_id, []).append(s.token)
                accepted[0] += sum(result.accepted.values())

            ranks.follower.on_result = record
            ranks.follow()
            json.dump({rid: [int(t) for array in arrays for t in array.reshape(-1).tolist()]
                       for rid, arrays in sampled.items()}, open(out_path + f".rank{ranks.group.rank}", "w"))
            json.dump({"param_bytes": param_bytes(model), "accepted_drafts": accepted[0]},
                      open(out_path + f".rank{ranks.group.rank}.footprint", "w"))
            return 0

        engines: list[Engine] = []

        def engine_for(max_num_seqs: int) -> Engine:
            # One engine for every scenario of a run, so request ids (the rank files' keys) stay unique.
            if not engines:
                engines.append(ranks.attach(Engine(model, tokenizer, **engine_settings(scenario))))
            return engines[0]

        result = {}
        for name in scenario.split(","):
            result.update(run(model, tokenizer, engine_for, name, lambda: ranks.leader.ledger.copies,
                              lambda: ranks.leader.ledger.score_items))
        result["kv_heads"] = model.layers[0].self_attn.n_kv_heads
        result.update(footprint(model, engines[0]))
    result["digests"] = ranks.rank_digests()  # after the `with`: every rank reported at Stop
    json.dump(result, open(out_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
