"""A public call's engine on distributed ranks (`batch_generate(..., ranks=session)`): rank 0's call builds its
private engine as usual, runs it on every rank for the call (`DistributedSession.attach`), and detaches it at the
end (the other ranks free its arena) before closing it. The other ranks call `session.follow()` meanwhile. See
docs/distributed.md."""

from __future__ import annotations

from typing import Any, Sequence

from cortexstream.errors import InvalidArgumentError


def check_ranks(ranks: Any, engine: Any) -> None:
    """`ranks` must be rank 0's session, and the call must build its own engine: an engine of the caller's is
    attached by the caller (`ranks.attach(engine)`), once, for as long as the caller wants."""
    if not callable(getattr(ranks, "attach", None)) or not hasattr(ranks, "is_leader"):
        raise InvalidArgumentError(f"ranks: expected a DistributedSession (cortexstream.distributed), got "
                                   f"{type(ranks).__name__}")
    if not ranks.is_leader:
        raise InvalidArgumentError("ranks: only rank 0 runs the call; every other rank calls ranks.follow()")
    if engine is not None:
        raise InvalidArgumentError("ranks: give engine (attached with ranks.attach(engine)) or ranks (the call "
                                   "attaches the engine it builds), not both")


def attach_private(ranks: Any, engine: Any) -> None:
    """Run the call's own `engine` on every rank; closes it when it cannot (DistributedError saying why)."""
    try:
        ranks.attach(engine)
    except BaseException:
        engine.close()
        raise


def check_rank_policies(engine: Any, ranks: Any, policies: Sequence[Any]) -> None:
    """Each prompt's KV policy against the ranks the call runs on (`ranks`, or those `engine` is attached to),
    before any engine is built or request starts: a policy the ranks cannot share is refused naming `kv_policy`
    (and the prompt, when the prompts have different policies)."""
    from cortexstream.policies.parsing import parse_policy

    if ranks is not None:
        from cortexstream.distributed import policy_problem as ask
    else:
        ask = getattr(getattr(engine, "plan_listener", None), "policy_problem", None)  # an attached engine's relay
        if not callable(ask):
            return
    for i, policy in enumerate(policies):
        problem = ask(parse_policy(policy))
        if problem is not None:
            where = "kv_policy" if len(set(map(repr, policies))) == 1 else f"kv_policy[{i}]"
            raise InvalidArgumentError(f"{where}: {problem}")


def release(engine: Any, ranks: Any, failed: bool) -> None:
    """The call's own engine at its end: detached from the ranks, then closed. After a failed call an error from
    detaching (the ranks may have stopped) is dropped, so that the call's own error is the one raised."""
    try:
        if ranks is not None:
            try:
                ranks.detach(engine)
            except Exception:
                if not failed:
                    raise
    finally:
        engine.close()


__all__ = ["attach_private", "check_rank_policies", "check_ranks", "release"]
