"""One rank of tests/test_distributed_batch.py: `batch_generate` over a batch of three prompts on two ranks.

    python distributed_batch_rank.py MODEL.gguf OUT.json [TIMEOUT]

Started without a launcher's variables (MLX_RANK, MLX_HOSTFILE) it runs alone and writes the reference: the batch
through `batch_generate`'s own engine, and through an engine built with ATTACHED. Started as a rank, every rank
loads MODEL and joins the session. Rank 0 writes to OUT.json:

- `refused`: the error of `batch_generate(..., ranks=ranks, kv_policy="sidecar")` (a policy the ranks cannot share);
- `private`, `private_again`: the batch through `batch_generate(..., ranks=ranks)` twice (each call attaches its own
  engine and detaches it at the end);
- `attached`: the batch on an engine built with ATTACHED and attached by the script (`engine=`);
- `steps`: the steps rank 0 sent; `kv_heads`: the KV heads its arena holds; `digests`: every rank's block-operation
  digest (after the session ended).

Every other rank follows and writes OUT.json.rank<N>: the tokens it sampled per request, and the steps it computed.
"""

from __future__ import annotations

import json
import sys

import cortexstream
from cortexstream.distributed import DistributedSession, launched
from cortexstream.engine.engine import Engine
from cortexstream.errors import InvalidArgumentError

PROMPTS = [[5, 17, 99, 42, 7], [3, 3, 8, 120, 64, 11, 2, 90], list(range(10, 50))]
MAX_TOKENS = [18, 11, 14]
ATTACHED = {"kv_tokens": 1024, "max_num_seqs": 3}


def batch(model, tokenizer, **kwargs) -> list[list[int]]:
    return cortexstream.batch_generate(model, tokenizer, PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True,
                                       **kwargs).token_ids


def alone(model, tokenizer) -> dict:
    return {"private": batch(model, tokenizer), "attached": batch(model, tokenizer,
                                                                  engine=Engine(model, tokenizer, **ATTACHED))}


def follow(ranks, out_path: str) -> None:
    sampled: dict[str, list[int]] = {}

    def record(result) -> None:
        for s in result.sampled:
            sampled.setdefault(s.request_id, []).extend(int(t) for t in s.token.reshape(-1).tolist())

    ranks.follower.on_result = record
    ranks.follow()
    json.dump({"sampled": sampled, "steps": ranks.follower.done}, open(f"{out_path}.rank{ranks.group.rank}", "w"))


def lead(model, tokenizer, ranks) -> dict:
    result: dict = {}
    try:
        batch(model, tokenizer, ranks=ranks, kv_policy="sidecar")
        result["refused"] = None
    except InvalidArgumentError as exc:
        result["refused"] = str(exc)
    result["private"] = batch(model, tokenizer, ranks=ranks)
    result["private_again"] = batch(model, tokenizer, ranks=ranks)
    result["attached"] = batch(model, tokenizer, engine=ranks.attach(Engine(model, tokenizer, **ATTACHED)))
    result["steps"] = ranks.leader.stats()["steps"]
    result["kv_heads"] = model.layers[0].self_attn.n_kv_heads
    return result


def main() -> int:
    path, out_path = sys.argv[1], sys.argv[2]
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    model, tokenizer = cortexstream.load(path)
    if not launched():
        json.dump(alone(model, tokenizer), open(out_path, "w"))
        return 0
    with DistributedSession.start(model, tokenizer, timeout=timeout) as ranks:
        if not ranks.is_leader:
            follow(ranks, out_path)
            return 0
        result = lead(model, tokenizer, ranks)
    result["digests"] = ranks.rank_digests()  # after the `with`: every rank reported at Stop
    json.dump(result, open(out_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
