"""Prompt-lookup speculation (`speculative="ngram:..."`) on two ranks on this machine (ring backend over 127.0.0.1),
on the tiny model split over them (tests/distributed_rank.py, scenario "ngram"):

- rank 0's scheduler drafts, each plan carries the drafts to every rank, and every rank verifies them in the same
  packed pass (k+1 rows per drafted sequence) and keeps the same tokens: four concurrent greedy requests with
  repetitive prompts give one process's tokens, with a fixed k and with the default adaptive k;
- drafts really run: with a fixed k (drafting does not depend on measured step times) the drafted and accepted
  counts are nonzero and equal one process's, and rank 1's runner accepted as many drafted tokens as rank 0's
  scheduler counted (a speculation path that silently turned off on the ranks would accept none);
- unseeded sampled requests draft too (each step's seed reaches every rank): rank 1 samples rank 0's tokens;
- both ranks end with the same block-operation digest (the rejected drafts' blocks are trimmed alike).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_distributed import RANK, START, assert_rank_tokens, ring, run_ranks, split_model  # noqa: F401


def test_prompt_lookup_on_two_ranks_gives_one_process_tokens_and_accepts_drafts(ring, split_model):  # noqa: F811
    local_out = ring / "ngram-local.json"
    subprocess.run([sys.executable, RANK, split_model, "local:ngram", str(local_out)], check=True, timeout=START)
    alone = json.loads(local_out.read_text())
    assert alone["ngram_fixed_accepted"] > 0  # the prompts make drafts that the model keeps

    rank0, rank1 = run_ranks(ring, split_model, "ngram")
    assert rank0["kv_heads"] == 1  # 2 KV heads over 2 ranks: the model really is split
    assert rank0["ngram_fixed"] == alone["ngram_fixed"]
    assert rank0["ngram"] == alone["ngram"]
    assert rank0["ngram"] == rank0["ngram_fixed"]  # greedy: drafting changes how many steps, not the tokens
    assert rank0["ngram_fixed_drafted"] == alone["ngram_fixed_drafted"] > 0
    assert rank0["ngram_fixed_accepted"] == alone["ngram_fixed_accepted"] > 0
    assert rank0["ngram_sampled_drafted"] > 0
    # Every rank verified the drafts: rank 1's runner kept as many drafted tokens as rank 0's scheduler counted.
    accepted = sum(rank0[f"{form}_accepted"] for form in ("ngram_fixed", "ngram", "ngram_sampled"))
    footprint = json.loads(Path(ring / "ngram.json.rank1.footprint").read_text())
    assert footprint["accepted_drafts"] == accepted
    assert_rank_tokens(rank0["ngram_fixed"] + rank0["ngram"] + rank0["ngram_sampled"], rank1)
    digests = rank0["digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]
