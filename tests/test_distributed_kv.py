"""Two ranks on this machine (as tests/test_distributed.py starts them) and the KV features that depend on what
each rank's arena holds: per-head KV policies that evict, the prefix cache, and `n > 1` completions forked from
one prompt's blocks (tests/distributed_kv_scenarios.py runs them).

- a policy that selects per KV head (h2o, expected, d2o, snapkv) gives one process's greedy tokens on two ranks, one
  stream and a batch, while it evicts as many tokens; on a model with one KV head per rank and on one with two (each
  rank's GQA groups);
- so does KVzip, whose reconstruction chunks (`StepPlan.score` items) every rank runs and rolls back: as many chunks
  as one process, as many tokens evicted once they ran, and the same block-operation digest on both ranks;
- so do the policies that merge per KV head (meanpool, tome), merging away as many tokens;
- a prompt seen before is served from rank 0's prefix cache (the cached tokens reported as one process reports
  them), with one process's tokens; so is the second of two prompts sharing a prefix;
- `Engine.fork` (the server's `n`): seeded completions equal one process's, the children copy the prompt's last
  block on write, and every rank samples the same unseeded completions;
- every run ends with the same block-operation digest on both ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distributed_kv_scenarios import MERGING, POLICIES
from test_distributed import RANK, START, ring, run_ranks, split_model  # noqa: F401  (fixtures)
from tiny_models import TINY_CONFIG, varied_tiny_model, write_tiny_gguf

GQA = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}  # 2 KV heads and 4 query heads per rank


@pytest.fixture(scope="module")
def gqa_model(ring) -> str:  # noqa: F811
    """A tiny model with 4 KV heads of 2 query heads each: two whole GQA groups per rank."""
    model = varied_tiny_model(seed=7, **GQA)
    path = str(ring / "gqa.gguf")
    write_tiny_gguf(path, model, config={**TINY_CONFIG, **GQA})
    return path


def alone(ring, model: str, scenarios: str) -> dict:  # noqa: F811
    """What one process without ranks generates for `scenarios`."""
    out = ring / f"local-{scenarios.replace(',', '-')}-{model.rsplit('/', 1)[-1]}.json"
    subprocess.run([sys.executable, RANK, model, f"local:{scenarios}", str(out)], check=True, timeout=START)
    return json.loads(out.read_text())


def same_digests(rank0: dict) -> bool:
    digests = rank0["digests"]
    return set(digests) == {"0", "1"} and digests["0"] == digests["1"]


@pytest.mark.parametrize("model_fixture, kv_heads", [("split_model", 1), ("gqa_model", 2)],
                         ids=["1-kv-head-per-rank", "2-kv-heads-per-rank"])
def test_per_head_policies_evict_on_two_ranks_as_one_process_does(ring, request, model_fixture, kv_heads):  # noqa: F811
    model = request.getfixturevalue(model_fixture)
    reference = alone(ring, model, "policies")
    rank0, _ = run_ranks(ring, model, "policies")
    assert rank0["kv_heads"] == kv_heads
    for policy in POLICIES:
        mine, theirs = rank0["policies"][policy], reference["policies"][policy]
        assert theirs["evicted"] > 0 and mine["evicted"] == theirs["evicted"], policy  # the policy evicted
        assert mine["single"] == theirs["single"], policy
        assert mine["batch"] == theirs["batch"], policy
        assert len(set(mine["single"])) > 3
    # D2O folds what H2O drops into what it keeps: the same choice, other values, other tokens.
    assert reference["policies"][POLICIES[2]]["single"] != reference["policies"][POLICIES[0]]["single"]
    assert same_digests(rank0)


MODELS = pytest.mark.parametrize("model_fixture, kv_heads", [("split_model", 1), ("gqa_model", 2)],
                                 ids=["1-kv-head-per-rank", "2-kv-heads-per-rank"])


@pytest.fixture(scope="module")
def compressing_runs(ring) -> dict:  # noqa: F811
    """model path -> (rank 0's, one process's) results of the "kvzip,merging" scenarios, each run once."""
    return {}


def compressing(ring, request, model_fixture: str, runs: dict) -> tuple[dict, dict]:  # noqa: F811
    model = request.getfixturevalue(model_fixture)
    if model not in runs:
        runs[model] = run_ranks(ring, model, "kvzip,merging")[0], alone(ring, model, "kvzip,merging")
    return runs[model]


@MODELS
def test_kvzip_reconstructs_and_evicts_on_two_ranks_as_one_process_does(ring, request, model_fixture,  # noqa: F811
                                                                         kv_heads, compressing_runs):
    rank0, reference = compressing(ring, request, model_fixture, compressing_runs)
    assert rank0["kv_heads"] == kv_heads
    mine, theirs = rank0["kvzip"], reference["kvzip"]
    # Every prompt was repeated in 16-token chunks (the stream's 50 tokens in 4, the batch's in 10) before evicting.
    assert rank0["kvzip_score_items"] == reference["kvzip_score_items"] == 14
    assert theirs["evicted"] > 0 and mine["evicted"] == theirs["evicted"]
    assert mine["single"] == theirs["single"] and len(set(mine["single"])) > 3
    assert mine["batch"] == theirs["batch"]
    assert same_digests(rank0)  # the chunks' blocks, reserved and given back after each rollback, alike on both


@MODELS
def test_per_head_merging_policies_merge_on_two_ranks_as_one_process_does(ring, request, model_fixture,  # noqa: F811
                                                                          kv_heads, compressing_runs):
    rank0, reference = compressing(ring, request, model_fixture, compressing_runs)
    assert rank0["kv_heads"] == kv_heads
    for policy in MERGING:
        mine, theirs = rank0["merging"][policy], reference["merging"][policy]
        assert theirs["evicted"] > 0 and mine["evicted"] == theirs["evicted"], policy  # tokens merged away
        assert mine["single"] == theirs["single"] and len(set(mine["single"])) > 3, policy
        assert mine["batch"] == theirs["batch"], policy
    # Token merging pairs each head's most similar keys, mean pooling averages fixed windows: other tokens.
    assert reference["merging"][MERGING[0]]["single"] != reference["merging"][MERGING[1]]["single"]
    assert same_digests(rank0)


def test_prefix_cache_and_forked_completions_on_two_ranks(ring, split_model):  # noqa: F811
    reference = alone(ring, split_model, "prefix,fork")
    rank0, rank1 = run_ranks(ring, split_model, "prefix,fork")
    assert rank0["prefix"] == reference["prefix"]  # tokens and cached prompt tokens per request
    (first,), (second,), pair = rank0["prefix"]
    assert first[1] == 0 and second[1] == 79  # the 80-token prompt again: all but its last token from the cache
    assert pair[0][1] == 0 and pair[1][1] == 64  # the second of the pair: the 64 tokens it shares
    assert rank0["prefix_hit_blocks"] == reference["prefix_hit_blocks"] > 0
    assert rank0["fork"] == reference["fork"] and len({tuple(t) for t in rank0["fork"]}) == 3
    assert rank0["fork_copies"] == reference["fork_copies"] > 0  # each child copied the prompt's last block
    for i, tokens in enumerate(rank0["fork_unseeded"]):  # every rank sampled them (rank 1 may hold one more)
        mine = rank1[f"fork-{4 + i}"]
        assert mine[: len(tokens)] == tokens and len(mine) - len(tokens) in (0, 1)
    assert same_digests(rank0)
