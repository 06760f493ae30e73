"""SequenceHook: the engine's one per-sequence extension point (C2C fusion and n > 1 forks use it)."""

from __future__ import annotations

import pytest

from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.scheduler import Scheduler
from cortexstream.kv.allocator import BlockAllocator
from cortexstream.engine.engine import Engine
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.sequence import Sequence, SequenceHook
from cortexstream.errors import InvalidArgumentError

PROMPT = list(range(3, 40))


def waiting(engine: Engine, request_id: str) -> Sequence:
    return next(s for s in engine.scheduler.waiting if s.request_id == request_id)


def run(engine: Engine) -> dict[str, tuple[str | None, str | None]]:
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error)
    return finished


def test_hook_runs_once_between_steps_with_exactly_at_token_tokens_in_the_kv(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4, prefill_step_size=8)
    rid = engine.add_request(PROMPT, max_tokens=3)
    seen: list[tuple[int, int]] = []
    engine.attach_hook(rid, SequenceHook(lambda s: seen.append((s.num_computed, s.num_physical)), 13))
    assert run(engine)[rid][0] == "length"
    assert seen == [(13, 13)]  # chunks were cut at the hook's token, and it ran once


def test_a_failing_hook_fails_only_its_request_with_its_name(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4)
    bad, good = engine.add_request(PROMPT, max_tokens=3), engine.add_request(PROMPT[:9], max_tokens=3)

    def explode(seq: Sequence) -> None:
        raise ValueError("no source")

    seq = waiting(engine, bad)
    engine.attach_hook(bad, SequenceHook.before_last_prompt_token(seq, explode, "test"))
    results = run(engine)
    assert results[bad] == ("error", "test hook failed: ValueError: no source")
    assert results[good][0] == "length"
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks


def test_hooks_are_validated_and_one_per_sequence():
    scheduler = Scheduler(BlockManager(BlockAllocator(16), 4))
    seq = Sequence(list(range(10)), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        SequenceHook(lambda s: None, -1)
    with pytest.raises(TypeError):
        SequenceHook("not callable", 3)  # type: ignore[arg-type]
    hook = SequenceHook.before_last_prompt_token(seq, lambda s: None, "first")
    assert hook.at_token == 9
    scheduler.attach_hook(seq, hook)
    with pytest.raises(InvalidArgumentError, match="already has a first hook"):
        scheduler.attach_hook(seq, SequenceHook(lambda s: None, 5, "second"))
    late = Sequence(list(range(10)), SamplingParams(max_tokens=2))
    late.num_computed = 6
    with pytest.raises(InvalidArgumentError, match="past token 5"):
        scheduler.attach_hook(late, SequenceHook(lambda s: None, 5))
