"""A request's life in the engine: its tokens, block table and status. Pure Python (no mlx).

Only the scheduler and the block manager write a `Sequence` (tests/test_step_plan.py checks it from the source);
everyone else reads it, and the runner never sees it: it gets a `StepPlan` (engine/step_plan.py)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.sampling import SamplingParams
from cortexstream.policies.base import FullCache, KVPolicy

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SequenceHook:
    """The engine's one per-sequence extension point: work done on a sequence from outside the model's forward
    pass, between two engine steps. C2C fusion writes another model's fused KV into the prompt's cache
    (`c2c.request_fusion.fuse_on_prefill`); the server forks n > 1 replies from one prefill (`engine.fork`).

    The scheduler cuts the sequence's prefill chunks so that its KV holds exactly its first `at_token` tokens,
    then, at the start of the next `schedule()` (no forward pass in flight), calls `run(seq)` once; the tokens
    after `at_token` are computed on whatever the hook left in the KV. With `at_token = len(prompt) - 1` the last
    prompt token, and so the first sampled token, already read the hook's KV. If `run` raises, the request
    finishes with finish_reason "error" and the reason (`"{name} hook failed: ..."`). A hook that writes KV
    the model would not compute from the tokens does so through `Engine.write_kv`, which marks the sequence's KV
    as not rebuildable from its tokens.
    """

    run: Callable[["Sequence"], None]
    at_token: int
    name: str = "sequence"

    def __post_init__(self) -> None:
        if not callable(self.run):
            raise TypeError(f"SequenceHook.run: {self.run!r} is not callable")
        if isinstance(self.at_token, bool) or not isinstance(self.at_token, int) or self.at_token < 0:
            raise ValueError(f"SequenceHook.at_token: {self.at_token!r} must be an integer >= 0")

    @classmethod
    def before_last_prompt_token(cls, seq: "Sequence", run: Callable[["Sequence"], None],
                                 name: str) -> "SequenceHook":
        """A hook that runs when every prompt token but the last is in the KV."""
        return cls(run, max(len(seq.prompt_ids) - 1, 0), name)


@dataclass(eq=False)
class Sequence:
    """One request. `num_computed` counts tokens (prompt + output) whose KV is in the cache."""

    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    tenant: str | None = None
    kv_policy: KVPolicy = field(default_factory=FullCache)  # what stays in the KV cache (see policies.base)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_physical: int = 0  # KV slots in use; below num_computed once a policy evicted or compressed
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash chain of the leading full blocks
    num_cached_prefix: int = 0  # prompt tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token_time: float | None = None
    owner: int = field(default_factory=lambda: next(_ids))
    # The per-sequence hook (see `SequenceHook`), None once it ran.
    hook: SequenceHook | None = None
    # False once something other than the model's forward over these tokens wrote the KV (a hook such as C2C
    # fusion): then the KV cannot be rebuilt from the tokens, so the scheduler never preempts the sequence by
    # recompute and the block manager never registers its blocks in the prefix cache.
    kv_from_tokens: bool = True
    # Sampled tokens whose values the engine has not read yet (0 or 1: the pipelined decode step in flight).
    # They count as tokens, so the scheduler plans the next decode step for them, but are not in output_ids.
    num_inflight: int = 0
    # A caller's prompt cache the sequence runs on instead of arena blocks (`engine.bound_cache.BoundCache`),
    # e.g. to continue a conversation kept in an mlx-lm cache. It takes no blocks and is never preempted.
    bound_cache: Any = None
    # The caller's own sampler (logprobs -> token) instead of the one `sampling` describes.
    sampler: Any = None
    # Speculative decoding state (`engine.speculation.SpeculationState`: drafter and adaptive length), or None.
    speculation: Any = None
    # KVzip: the reconstruction chunks it runs after its prompt (`engine.reconstruction_plan.ReconstructionPlan`).
    reconstruction: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    def token_at(self, index: int) -> int:
        """Token `index` of prompt + output (cheaper than all_ids[index]: no list copy)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[index] if index < prompt else self.output_ids[index - prompt]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed (the whole prompt at first, then one per decode step)."""
        return self.num_tokens - self.num_computed

    @property
    def uses_arena(self) -> bool:
        return self.bound_cache is None

    @property
    def prefills_alone(self) -> bool:
        """Whether its prefill chunks need forward passes of their own: a policy that evicts acts between its
        own passes, and a bound cache cannot join a batch over the arena."""
        return self.kv_policy.evicts or self.bound_cache is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens [start, stop) of prompt + output, without copying the whole history."""
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return tuple(self.prompt_ids[start:stop])
        if start >= prompt:
            return tuple(self.output_ids[start - prompt : stop - prompt])
        return tuple(self.prompt_ids[start:]) + tuple(self.output_ids[: stop - prompt])
