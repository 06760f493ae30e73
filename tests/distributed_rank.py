"""One rank of a distributed test run (tests/test_distributed.py starts two of these, or mlx.launch does).

    python distributed_rank.py MODEL.gguf SCENARIOS OUT.json [TIMEOUT [IDLE_SECONDS]]

Every rank loads MODEL and joins the session; rank 0 runs each comma-separated scenario and writes what it
generated to OUT.json, every other rank writes the tokens it sampled per request to OUT.json.rank<N>. Scenarios:
"single" (one greedy stream), "batch" (concurrent greedy prompts through batch_generate), "sampled" (seeded and
unseeded sampled requests), "streaming" (a position-based KV policy), "idle" (rank 0 generates, waits
IDLE_SECONDS without stepping, generates again), "long" (generates until a rank is killed; OUT.json.started
appears after the first tokens). "local" runs single and batch in one process without ranks: the reference.
"""

from __future__ import annotations

import json
import sys
import time

import cortexstream
from cortexstream.distributed import DistributedSession
from cortexstream.engine.engine import Engine

PROMPTS = [[5, 17, 99, 42, 7], [3, 3, 8, 120, 64, 11, 2, 90], [77], list(range(10, 50))]


def run(model, tokenizer, engine_for, scenario: str) -> dict:
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
    if scenario == "local":  # one process, no ranks: the reference output
        result = {}
        for name in ("single", "batch"):
            result.update(run(model, tokenizer, lambda n: Engine(model, tokenizer, kv_tokens=2048, max_num_seqs=n),
                              name))
        json.dump(result, open(out_path, "w"))
        return 0
    with DistributedSession.start(model, tokenizer, timeout=timeout) as ranks:
        if not ranks.is_leader:
            sampled: dict[str, list] = {}
            ranks.follower.on_result = lambda result: [sampled.setdefault(s.request_id, []).append(s.token)
                                                       for s in result.sampled]
            ranks.follow()
            json.dump({rid: [int(t) for array in arrays for t in array.reshape(-1).tolist()]
                       for rid, arrays in sampled.items()}, open(out_path + f".rank{ranks.group.rank}", "w"))
            return 0

        engines: list[Engine] = []

        def engine_for(max_num_seqs: int) -> Engine:
            # One engine for every scenario of a run, so request ids (the rank files' keys) stay unique.
            if not engines:
                engines.append(ranks.attach(Engine(model, tokenizer, kv_tokens=2048, max_num_seqs=4)))
            return engines[0]

        result = {}
        for name in scenario.split(","):
            result.update(run(model, tokenizer, engine_for, name))
        result["kv_heads"] = model.layers[0].self_attn.n_kv_heads
        json.dump(result, open(out_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
