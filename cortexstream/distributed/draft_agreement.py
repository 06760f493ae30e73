"""Draft-model speculation on several ranks: every rank's drafts compared before the target verifies them.

Every rank holds the whole draft model and drafts on the same inputs (the plan's catch-up tokens and block tables,
the step's random seed), so the drafts should be the same everywhere. They are not guaranteed to be: floating-point
results may differ between machines (another CPU, another BLAS path), and a rank whose draft differs would verify
other tokens than rank 0 in the same sharded pass, accept another count and leave its KV holding other tokens, a
divergence nothing else would notice at once. So after each drafting pass every rank all-gathers, per drafting
request in the pass's order, its drafted tokens and, for a sampled request, a digest of the bytes of the draft
distributions its rejection sampling reads (a greedy request's distribution is a point mass on its token). Every
rank then sees the same gathered array and reaches the same verdict in the same step: when a rank differs, each
raises a DistributedError naming the request and both ranks' drafts, before anything is verified.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.distributed.errors import DistributedError
from cortexstream.engine.draft_runner import Proposal
from cortexstream.engine.sampling import SamplingParams

DIGEST_WORDS = 2  # int32 words of a sampled request's distribution digest (64 bits)


def proposal_words(proposal: Proposal, sampling: SamplingParams) -> list[int]:
    """One request's entry: its drafted tokens, then (sampled requests) the digest of its draft distributions."""
    words = [int(token) for token in proposal.tokens]
    if not sampling.greedy:
        data = np.asarray(proposal.logprobs.astype(mx.float32)).tobytes()
        digest = hashlib.blake2b(data, digest_size=4 * DIGEST_WORDS).digest()
        words += [int(word) for word in np.frombuffer(digest, dtype=np.int32)]
    return words


class DraftAgreement:
    """A `DraftRunner.agree_with` check for `size` ranks; `gather(x)` stacks every rank's `x` in rank order
    (the group's all-gather by default)."""

    def __init__(self, group: Any, size: int, gather: Callable[[mx.array], mx.array] | None = None) -> None:
        if size < 2:
            raise DistributedError(f"size: draft agreement needs at least 2 ranks, got {size}")
        self.size = size
        self._gather = gather if gather is not None else (
            lambda x: mx.distributed.all_gather(x, group=group))
        self.passes = 0  # drafting passes compared so far

    def __call__(self, proposals: dict[str, Proposal], samplings: dict[str, SamplingParams]) -> None:
        entries = [(rid, proposal_words(proposal, samplings[rid])) for rid, proposal in proposals.items()]
        mine = np.asarray([word for _, words in entries for word in words], dtype=np.int32)
        if not mine.size:  # nothing drafted on any rank (the plan fixes the counts)
            return
        gathered = self._gather(mx.array(mine))
        mx.eval(gathered)
        table = np.asarray(gathered).reshape(self.size, -1)
        self.passes += 1
        for rank in range(1, self.size):
            if not np.array_equal(table[rank], table[0]):
                raise DistributedError(self._why(entries, table, rank, samplings))

    @staticmethod
    def _why(entries: list[tuple[str, list[int]]], table: np.ndarray, rank: int,
             samplings: dict[str, SamplingParams]) -> str:
        """The first request whose drafts differ between rank 0 and `rank`, as an error message."""
        at = 0
        for rid, words in entries:
            theirs, ours = table[rank, at: at + len(words)], table[0, at: at + len(words)]
            at += len(words)
            if np.array_equal(theirs, ours):
                continue
            k = len(words) - (0 if samplings[rid].greedy else DIGEST_WORDS)
            what = (f"drafted tokens {theirs[:k].tolist()} for request {rid!r} where rank 0 drafted "
                    f"{ours[:k].tolist()}") if not np.array_equal(theirs[:k], ours[:k]) else (
                f"drafted request {rid!r}'s tokens {ours[:k].tolist()} from other draft probabilities than rank 0")
            return (f"draft-model speculation: rank {rank} {what}: the ranks' whole copies of the draft model "
                    "computed different results (floating point differs between these ranks); run without "
                    "draft-model speculation on these ranks")
        return f"draft-model speculation: rank {rank} drafted differently from rank 0"


__all__ = ["DraftAgreement", "proposal_words"]
