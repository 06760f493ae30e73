"""`bench throughput` as one of several ranks (started by mlx.launch or mpirun): CortexStream's rows only.

Every rank loads the model and joins the ranks (the model is split in place, as `cortexstream generate` and
`serve` split it). Rank 0 runs the benchmark's parts with our engine on every rank, each call as its public form
runs there: the matrix through `batch_generate(..., ranks=session)` (its own engine, attached for the call), the
single stream through `generate` on a private engine attached as `cortexstream generate` attaches it (then
detached, so the other ranks free its arena), the ITL part's engine attached for its round. The other ranks follow
and return when rank 0 leaves the session; rank 0 alone writes the results. The settings record the rank count and
the backend.

mlx-lm's anchor rows (`mlx_lm.batch_generate`, `mlx_lm.generate`) are not measured there: `ANCHORS_SKIPPED` says
why, and the report repeats it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

ANCHORS_SKIPPED = ("mlx-lm's batch_generate and generate are not measured on several ranks: they would run on rank 0 "
                   "alone, and on a model split over the ranks each of their forward passes would wait in the split "
                   "layers' collectives for ranks that do not run them. Without them there are no ratios, no "
                   "targets and no identical-output counts: the rows are CortexStream's alone, every step computed "
                   "on every rank, and memory is rank 0's")


@dataclass(frozen=True)
class JoinedRanks:
    """This process's part in the benchmark's ranks: the model (split in place), its session, the backend's name."""

    model: Any
    tokenizer: Any
    session: Any  # DistributedSession
    backend: str


def join_ranks(args: argparse.Namespace) -> JoinedRanks:
    """Load --model on this rank and join the others over --rank-backend (checked by the caller, with
    --rank-timeout, before the model loads); the model is then split over them. DistributedError when the ranks
    cannot run it."""
    from cortexstream.distributed import DistributedSession
    from cortexstream.distributed.backends import BACKEND_FLAG, choose_backend
    from cortexstream.models.loader import load

    choice = choose_backend(args.rank_backend, BACKEND_FLAG)
    model, tokenizer = load(args.model)
    session = DistributedSession.start(model, tokenizer, backend=choice, timeout=args.rank_timeout)
    return JoinedRanks(model, tokenizer, session, choice.backend.value)


def generate_on_ranks(ranks: Any, model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> str:
    """`cortexstream.generate` as `cortexstream generate` runs it on ranks (cli/distributed.py): a private engine
    sized for the request and attached to every rank; detached (the other ranks free its arena) and closed after."""
    import cortexstream
    from cortexstream.cli.distributed import generate_engine
    from cortexstream.engine.sampling import SamplingParams
    from cortexstream.generation.ranks import release

    engine = generate_engine(ranks, model, tokenizer, prompt, SamplingParams(max_tokens=max_tokens), None, None,
                             None)
    failed = True
    try:
        text = cortexstream.generate(model, tokenizer, prompt, max_tokens=max_tokens, engine=engine)
        failed = False
        return text
    finally:
        release(engine, ranks, failed)  # the call's own error wins over one from detaching


def on_ranks(payload: dict[str, Any]) -> int:
    """How many ranks a results payload was measured on (1 for one process, and for files older than the field)."""
    return int(payload["settings"].get("ranks", 1))


__all__ = ["ANCHORS_SKIPPED", "JoinedRanks", "generate_on_ranks", "join_ranks", "on_ranks"]
