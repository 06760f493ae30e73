"""The CLI's side of distributed ranks: under `mlx.launch` (several ranks), `generate` and `serve` split the model
over the ranks; rank 0 runs the command, the other ranks follow it and print nothing. See docs/distributed.md."""

from __future__ import annotations

import argparse
from typing import Any

from cortexstream.errors import InvalidArgumentError

DEFAULT_RANK_TIMEOUT = 60.0


def add_rank_timeout_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT, metavar="SECONDS",
                        help="under mlx.launch with several ranks: seconds a rank may stay silent (or one step may "
                             "take) before the others stop with an error naming it (default 60)")


def check_rank_timeout(args: argparse.Namespace) -> None:
    """--rank-timeout, before the model loads."""
    if not args.rank_timeout > 0:
        raise InvalidArgumentError(f"--rank-timeout: {args.rank_timeout!r} must be a number of seconds > 0")


def join_ranks(args: argparse.Namespace, model: Any, tokenizer: Any) -> Any:
    """The DistributedSession of this process when mlx.launch started it as one of several ranks (the model is
    then split in place), else None."""
    from cortexstream.distributed import DistributedSession, launched

    if not launched():
        return None
    return DistributedSession.start(model, tokenizer, timeout=args.rank_timeout)


def follow(ranks: Any) -> int:
    """Every rank but 0: run rank 0's steps until it stops."""
    ranks.follow()
    return 0


def generate_engine(ranks: Any, model: Any, tokenizer: Any, prompt: Any, sampling: Any, policy: Any,
                    kv_dtype: str | None, kv_group_size: int | None) -> Any:
    """Rank 0's engine for one `generate` request (sized as stream_generate sizes its private one), attached to
    the other ranks. DistributedError for a --kv-policy the ranks cannot share."""
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
    engine = Engine(model, tokenizer, max_num_seqs=1, prefill_step_size=512, prefix_caching=False, arena=arena)
    return ranks.attach(engine)
