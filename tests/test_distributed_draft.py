"""Draft-model speculation (`speculative="draft:model=...,k=3"`) on two ranks on this machine (ring backend over
127.0.0.1), the target split over them, the draft model whole on each (tests/distributed_rank.py, scenario "draft",
tests/distributed_draft_scenarios.py):

- greedy tokens equal one process's for one stream and for 4 concurrent requests, with nonzero drafted and
  accepted counts, fewer accepted than drafted in one process (the draft model is not the target); rank 1's runner accepted as many drafted tokens as rank 0's scheduler counted, and rank 1 sampled rank
  0's tokens; both ranks end with the same block-operation digest;
- requests sampled without a seed draft too, and rank 1 samples rank 0's tokens; seeded sampled requests running in
  the same steps give one process's tokens;
- a draft model that only rank 0 can load (a relative path, the ranks in different working directories) ends both
  ranks with an error naming the source;
- a draft model that differs on rank 1 (the same relative path, another file) is caught in the first drafting pass:
  both ranks stop with an error naming the request and both drafts, instead of diverging.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from cortexstream.distributed.local_ranks import rank_environment, write_local_hostfile
from distributed_draft_scenarios import DRAFT_FILE
from test_distributed import RANK, START, TIMEOUT, assert_rank_tokens, finish, ring, run_ranks, split_model  # noqa: F401
from tiny_models import varied_tiny_model, write_tiny_gguf


def _draft_model(scale: float):
    """The target's weights (varied_tiny_model(seed=7)) with every MLP output scaled: a draft that agrees with the
    target on some tokens and not on others."""
    model = varied_tiny_model(seed=7)
    for layer in model.model.layers:
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * scale
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def draft(split_model) -> str:  # noqa: F811
    path = Path(split_model).with_name(DRAFT_FILE)
    write_tiny_gguf(str(path), _draft_model(0.8))
    return str(path)


def test_draft_model_speculation_on_two_ranks_gives_one_process_tokens(ring, split_model, draft):  # noqa: F811
    local_out = ring / "draft-local.json"
    subprocess.run([sys.executable, RANK, split_model, "local:draft", str(local_out)], check=True, timeout=START)
    alone = json.loads(local_out.read_text())
    for part in ("draft_single", "draft_batch"):
        assert 0 < alone[f"{part}_accepted"] < alone[f"{part}_drafted"]

    rank0, rank1 = run_ranks(ring, split_model, "draft")
    assert rank0["kv_heads"] == 1  # 2 KV heads over 2 ranks: the target really is split
    assert rank0["draft_single"] == alone["draft_single"]
    assert rank0["draft_batch"] == alone["draft_batch"]
    assert rank0["draft_seeded"] == alone["draft_seeded"]
    # Counts are not compared with one process's: the draft model computes each prompt chunk in the chunk's step,
    # and the chunks of concurrent prompts follow the measured step costs, so a near-tie in the draft's logits may
    # fall either way from run to run (the tokens are the target's either way). Rank 1 against rank 0 is exact.
    for part in ("draft_single", "draft_batch"):
        assert 0 < rank0[f"{part}_accepted"] <= rank0[f"{part}_drafted"]
    assert rank0["draft_sampled_drafted"] > 0  # the unseeded sampled requests drafted
    # Every rank verified the drafts: rank 1's runner kept as many drafted tokens as rank 0's scheduler counted.
    accepted = sum(rank0[f"{part}_accepted"] for part in ("draft_single", "draft_batch", "draft_sampled"))
    footprint = json.loads(Path(ring / "draft.json.rank1.footprint").read_text())
    assert footprint["accepted_drafts"] == accepted
    assert_rank_tokens([rank0["draft_single"]] + rank0["draft_batch"] + rank0["draft_unseeded"]
                       + rank0["draft_seeded"], rank1)
    digests = rank0["digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]


def _run_in_folders(ring: Path, model: str, name: str, folders: list[Path]) -> list[tuple[int, str]]:
    """The "draft" scenario with the relative source DRAFT_FILE, rank r started in `folders[r]`."""
    hostfile = write_local_hostfile(ring)
    out = ring / f"{name}.json"
    procs = [subprocess.Popen([sys.executable, RANK, model, "draft", str(out), str(TIMEOUT), DRAFT_FILE],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder,
                              env=rank_environment(rank, hostfile))
             for rank, folder in enumerate(folders)]
    return finish(procs, START)


def test_a_draft_model_only_rank_0_can_load_is_refused_naming_it(ring, split_model, draft):  # noqa: F811
    here, elsewhere = ring / "has-draft", ring / "no-draft"
    for folder in (here, elsewhere):
        folder.mkdir(exist_ok=True)
    shutil.copy(draft, here / DRAFT_FILE)
    results = _run_in_folders(ring, split_model, "draft-missing", [here, elsewhere])
    assert [code for code, _ in results] == [1, 1], [err[-2000:] for _, err in results]
    for _, err in results:
        assert f"cannot load the draft model '{DRAFT_FILE}'" in err, err[-2000:]
        assert "rank 1" in err


def test_drafts_that_differ_between_ranks_stop_both_ranks(ring, split_model, draft):  # noqa: F811
    mine, theirs = ring / "draft-a", ring / "draft-b"
    for folder in (mine, theirs):
        folder.mkdir(exist_ok=True)
    shutil.copy(draft, mine / DRAFT_FILE)
    write_tiny_gguf(str(theirs / DRAFT_FILE), _draft_model(0.3))  # same vocabulary, other weights
    results = _run_in_folders(ring, split_model, "draft-differs", [mine, theirs])
    assert [code for code, _ in results] == [1, 1], [err[-2000:] for _, err in results]
    for _, err in results:
        assert "draft-model speculation: rank 1 drafted" in err, err[-2000:]


def test_cortexstream_generate_with_a_draft_model_under_mlx_launch_prints_what_one_process_prints(
        ring, split_model, draft):  # noqa: F811
    """The CLI on two ranks: `generate --speculative draft:...` builds rank 0's engine with the draft model (every
    rank loads it) and prints one process's greedy text."""
    from test_distributed import LAUNCH, free_port_pair

    command = [str(Path(sys.executable).parent / "cortexstream"), "generate", "--model", split_model, "-p",
               "hello world", "-m", "24", "--no-chat-template", "--rank-timeout", str(TIMEOUT),
               "--speculative", f"draft:model={draft},k=3"]
    plain = subprocess.run(command[:-2], capture_output=True, timeout=START)
    alone = subprocess.run(command, capture_output=True, timeout=START)
    launched = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p",
                               str(free_port_pair()), "--", *command], capture_output=True, timeout=START)
    assert plain.returncode == 0 and alone.returncode == 0, alone.stderr[-2000:]
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout == plain.stdout and len(alone.stdout) > 24  # rank 1 printed nothing


def test_cortexstream_serve_with_a_draft_model_on_two_ranks_answers_as_one_process_generates(
        ring, split_model, draft):  # noqa: F811
    """`serve --speculative draft:...` under two ranks: greedy completions (drafting, and a request that turns
    speculation off) give one process's `generate` text; both ranks stop with the server."""
    import signal

    from test_distributed import http, start_server

    command = [str(Path(sys.executable).parent / "cortexstream"), "generate", "--model", split_model, "-p",
               "hello world", "-m", "16", "--no-chat-template"]
    alone = subprocess.run(command, capture_output=True, text=True, timeout=START)
    assert alone.returncode == 0, alone.stderr[-2000:]
    procs, port, _ = start_server(ring, split_model, "--speculative", f"draft:model={draft},k=3")
    try:
        body = {"prompt": "hello world", "max_tokens": 16, "temperature": 0}
        drafted, plain = http(port, "/v1/completions", body), http(port, "/v1/completions",
                                                                  {**body, "speculative": "off"})
        assert drafted[0] == plain[0] == 200, (drafted, plain)
        assert drafted[1]["choices"][0]["text"] == plain[1]["choices"][0]["text"] == alone.stdout.rstrip("\n")
        procs[0].send_signal(signal.SIGTERM)
        results = finish(procs, 30)
    finally:
        for proc in procs:
            proc.kill()
    assert [code for code, _ in results] == [0, 0], [err[-1500:] for _, err in results]


# --- the agreement check alone (one process; `gather` stands in for the all-gather of two ranks) ----------------

def _proposals(tokens: dict[str, list[int]], shift: float = 0.0) -> dict:
    from cortexstream.engine.draft_runner import Proposal

    vocab = 8
    return {rid: Proposal(tuple(ids), mx.log(mx.softmax(mx.arange(len(ids) * vocab).reshape(len(ids), vocab)
                                                       * (0.1 + shift), axis=-1)))
            for rid, ids in tokens.items()}


def _two_ranks(theirs: dict, samplings: dict):
    from cortexstream.distributed.draft_agreement import proposal_words

    other = mx.array([w for rid, p in theirs.items() for w in proposal_words(p, samplings[rid])], dtype=mx.int32)
    return lambda mine: mx.concatenate([mine, other])


def test_equal_drafts_pass_and_a_rank_that_drafted_other_tokens_stops_naming_both():
    from cortexstream.distributed import DistributedError
    from cortexstream.distributed.draft_agreement import DraftAgreement
    from cortexstream.engine.sampling import SamplingParams

    samplings = {"a": SamplingParams(), "b": SamplingParams()}
    mine = _proposals({"a": [4, 5, 6], "b": [1, 2]})
    check = DraftAgreement(None, 2, gather=_two_ranks(mine, samplings))
    check(mine, samplings)
    assert check.passes == 1
    check = DraftAgreement(None, 2, gather=_two_ranks(_proposals({"a": [4, 5, 6], "b": [1, 3]}), samplings))
    with pytest.raises(DistributedError, match=r"rank 1 drafted tokens \[1, 3\] for request 'b' where rank 0 "
                                               r"drafted \[1, 2\]"):
        check(mine, samplings)


def test_sampled_drafts_from_other_probabilities_stop_the_ranks_and_greedy_ones_compare_tokens_only():
    from cortexstream.distributed import DistributedError
    from cortexstream.distributed.draft_agreement import DraftAgreement
    from cortexstream.engine.sampling import SamplingParams

    mine, shifted = _proposals({"a": [4, 5]}), _proposals({"a": [4, 5]}, shift=1e-3)
    sampled = {"a": SamplingParams(temperature=0.7)}
    check = DraftAgreement(None, 2, gather=_two_ranks(mine, sampled))
    check(mine, sampled)
    check = DraftAgreement(None, 2, gather=_two_ranks(_proposals({"a": [4, 5]}, shift=0.3), sampled))
    with pytest.raises(DistributedError, match="from other draft probabilities"):
        check(mine, sampled)
    greedy = {"a": SamplingParams()}  # a greedy draft's distribution is a point mass on its token
    DraftAgreement(None, 2, gather=_two_ranks(shifted, greedy))(mine, greedy)
