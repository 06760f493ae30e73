"""The CLI's side of distributed ranks: under `mlx.launch` or `mpirun` (several ranks), `generate` and `serve`
split the model over the ranks; rank 0 runs the command, the other ranks follow it and print nothing. See
docs/distributed.md."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any, Callable

from cortexstream.errors import InvalidArgumentError

DEFAULT_RANK_TIMEOUT = 60.0
FAILURE_GRACE = 5.0  # seconds a server answers 503 with the reason after a rank failed, before it exits


class ServeFailure:
    """Rank 0's reaction when a rank dies or hangs under `serve`: once `mark` is set (the server's bridge.fail),
    /health and every new or open request answer 503 with the reason, and the process exits with status 1 after
    `grace` seconds (the engine thread may be stuck in a collective, which nothing can interrupt). Before the
    server exists, it ends the process at once, as `generate` does."""

    def __init__(self, grace: float = FAILURE_GRACE) -> None:
        self.grace = grace
        self.mark: Callable[[str], None] | None = None

    def __call__(self, reason: str) -> None:
        print(f"cortexstream: error: distributed: {reason}", file=sys.stderr, flush=True)
        if self.mark is None:
            os._exit(1)
        self.mark(f"distributed ranks failed: {reason}")
        timer = threading.Timer(self.grace, _exit_failed)
        timer.daemon = True
        timer.start()


def _exit_failed() -> None:
    print("cortexstream serve: stopped after a rank failed", file=sys.stderr, flush=True)
    os._exit(1)


def add_rank_args(parser: argparse.ArgumentParser) -> None:
    """--rank-timeout and --rank-backend: how this process runs when a launcher started it as one of several ranks."""
    parser.add_argument("--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT, metavar="SECONDS",
                        help="under mlx.launch or mpirun with several ranks: seconds a rank may stay silent (or one "
                             "step may take) before the others stop with an error naming it (default 60)")
    parser.add_argument("--rank-backend", default=None, metavar="BACKEND",
                        help="under mlx.launch or mpirun with several ranks: the MLX backend that connects them, "
                             "'ring' or 'mpi' (default: $CORTEXSTREAM_RANK_BACKEND, else mpi under mpirun, else "
                             "ring)")


def check_rank_args(args: argparse.Namespace) -> None:
    """--rank-timeout and --rank-backend, before the model loads: an unknown or never verified backend is refused
    with the flag (or variable) named."""
    from cortexstream.distributed import DistributedError, launched
    from cortexstream.distributed.backends import BACKEND_FLAG, choose_backend

    if not args.rank_timeout > 0:
        raise InvalidArgumentError(f"--rank-timeout: {args.rank_timeout!r} must be a number of seconds > 0")
    try:
        choice = choose_backend(args.rank_backend, BACKEND_FLAG)
        if launched() or args.rank_backend is not None:
            choice.check_verified()
    except DistributedError as exc:
        raise InvalidArgumentError(str(exc)) from None


def join_ranks(args: argparse.Namespace, model: Any, tokenizer: Any,
               on_failure: Callable[[str], None] | None = None) -> Any:
    """The DistributedSession of this process when a launcher started it as one of several ranks (the model is
    then split in place), else None. `on_failure(reason)` runs on rank 0 when a rank dies or hangs (default: say
    why and exit with status 1)."""
    from cortexstream.distributed import DistributedSession, launched
    from cortexstream.distributed.backends import BACKEND_FLAG, choose_backend
    from cortexstream.distributed.session import exit_on_failure

    if not launched():
        return None
    return DistributedSession.start(model, tokenizer, backend=choose_backend(args.rank_backend, BACKEND_FLAG),
                                    timeout=args.rank_timeout, on_failure=on_failure or exit_on_failure)


def follow(ranks: Any) -> int:
    """Every rank but 0: run rank 0's steps until it stops."""
    ranks.follow()
    return 0


def generate_engine(ranks: Any, model: Any, tokenizer: Any, prompt: Any, sampling: Any, policy: Any,
                    kv_dtype: str | None, kv_group_size: int | None, speculative: str | None = None) -> Any:
    """Rank 0's engine for one `generate` request (sized as stream_generate sizes its private one), attached to
    the other ranks; `speculative` its default (a draft model is loaded by every rank). DistributedError for a
    --kv-policy the ranks cannot share."""
    from cortexstream.distributed import DistributedError, policy_problem
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.prompt import prompt_to_tokens
    from cortexstream.engine.sizing import private_arena
    from cortexstream.policies import parse_policy

    policy = parse_policy(policy)
    problem = policy_problem(policy)
    if problem is not None:
        raise DistributedError(f"--kv-policy: {problem}")
    job = [(len(prompt_to_tokens(tokenizer, prompt)), sampling.max_tokens, policy)]
    arena = private_arena(model, job, block_size=16, prefill_step_size=512, kv_dtype=kv_dtype,
                          kv_group_size=kv_group_size)
    engine = Engine(model, tokenizer, max_num_seqs=1, prefill_step_size=512, prefix_caching=False, arena=arena,
                    speculative=speculative)
    return ranks.attach(engine)
