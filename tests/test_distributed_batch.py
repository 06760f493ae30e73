"""`batch_generate` on two ranks on this machine (ring backend over 127.0.0.1, started by mlx.launch), on the tiny
model split over them (tests/distributed_batch_rank.py runs each rank):

- `batch_generate(..., ranks=session)` builds its own engine, runs it on both ranks and detaches it at the end:
  the three prompts' tokens equal one process's `batch_generate` (and again on a second call);
- `batch_generate(..., engine=ranks.attach(Engine(...)))` gives one process's tokens on the same engine settings;
- rank 1 samples the tokens rank 0 returned and computes every step rank 0 sent; both ranks end with the same
  block-operation digest;
- a KV policy the ranks cannot share is refused before any engine is built, naming `kv_policy`;
- misuse of `ranks` (not a session, a rank that follows, with an `engine` too) is refused naming `ranks`
  (in-process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cortexstream.distributed.local_ranks import free_port_pair
from cortexstream.errors import InvalidArgumentError
from distributed_batch_rank import MAX_TOKENS, PROMPTS
from test_distributed import LAUNCH, START, TIMEOUT, assert_rank_tokens, ring, split_model  # noqa: F401

SCRIPT = str(Path(__file__).resolve().parent / "distributed_batch_rank.py")


def test_batch_generate_on_two_ranks_gives_one_process_tokens(ring, split_model):  # noqa: F811
    alone_out = ring / "batch-alone.json"
    subprocess.run([sys.executable, SCRIPT, split_model, str(alone_out)], check=True, timeout=START)
    alone = json.loads(alone_out.read_text())
    assert len(alone["private"]) == len(PROMPTS) and len({t for ts in alone["private"] for t in ts}) > 5
    assert all(0 < len(tokens) <= limit for tokens, limit in zip(alone["private"], MAX_TOKENS))

    out = ring / "batch-ranks.json"
    tic = time.monotonic()
    proc = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p",
                           str(free_port_pair()), "--", sys.executable, SCRIPT, split_model, str(out), str(TIMEOUT)],
                          capture_output=True, text=True, timeout=START)
    assert time.monotonic() - tic < START
    # mlx.launch exits with 0 even when a rank failed: the ranks' files say whether they finished.
    assert proc.returncode == 0 and out.exists() and Path(f"{out}.rank1").exists(), proc.stderr[-2000:]
    rank0, rank1 = json.loads(out.read_text()), json.loads(Path(f"{out}.rank1").read_text())
    assert rank0["kv_heads"] == 1  # 2 KV heads split over 2 ranks: the model really is split
    assert rank0["private"] == alone["private"]
    assert rank0["private_again"] == alone["private"]
    assert rank0["attached"] == alone["attached"]
    assert rank0["refused"] is not None and rank0["refused"].startswith("kv_policy: ")
    assert "merges_per_head" in rank0["refused"], rank0["refused"]
    # Rank 1 ran each call's engine: it sampled the tokens rank 0 returned, in request order.
    assert_rank_tokens(rank0["private"] + rank0["private_again"] + rank0["attached"], rank1["sampled"])
    assert rank1["steps"] == rank0["steps"] > 0
    digests = rank0["digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]


class StandIn:
    """An object in a DistributedSession's place: `attach` and `is_leader`, nothing else."""

    def __init__(self, is_leader: bool) -> None:
        self.is_leader = is_leader
        self.attached: list = []

    def attach(self, engine):
        self.attached.append(engine)
        return engine


@pytest.mark.parametrize("ranks, engine, message", [
    (object(), False, "ranks: expected a DistributedSession"),
    (StandIn(is_leader=False), False, "ranks: only rank 0 runs the call"),
    (StandIn(is_leader=True), True, "ranks: give engine"),
], ids=["not-a-session", "a-follower", "with-an-engine"])
def test_misused_ranks_are_refused_naming_ranks(tiny, ranks, engine, message):
    from cortexstream import batch_generate
    from cortexstream.engine.engine import Engine

    model, tokenizer = tiny
    with pytest.raises(InvalidArgumentError, match=message):
        batch_generate(model, tokenizer, PROMPTS, max_tokens=2, ranks=ranks,
                       engine=Engine(model, tokenizer, kv_tokens=256) if engine else None)
    assert not getattr(ranks, "attached", [])  # refused before anything was attached
