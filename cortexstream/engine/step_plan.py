"""The data contract of one engine step: `StepPlan` down from the scheduler, `StepResult` up from the runner.

The scheduler (with the block manager) owns every sequence's state. Each step it emits a `StepPlan` of plain,
immutable data: which requests the runner meets for the first time (`NewRequest`), which it must forget
(`dropped`), the blocks to copy before anything is written (copy-on-write pairs), and one `WorkItem` per request
with the tokens to compute, their positions, its block table and whether to sample. The runner executes the plan
and returns a `StepResult`; the engine applies it through the scheduler. Neither side reads the other's objects,
and no block table is shared by reference: a runner given the same plans in the same order computes the same KV
and the same tokens (tests/test_step_plan.py replays them), which is what a speculative rollback, a disk tier or the
ranks of a distributed engine consume.

Pipelined decode: a decode item whose `token_ids` is empty computes the token the runner sampled last for that
request (still lazy, not read by anyone yet), so a step can be launched before the previous one's tokens are read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cortexstream.engine.sampling import SamplingParams
from cortexstream.policies.base import KVPolicy


class WorkKind(enum.Enum):
    PREFILL = "prefill"  # prompt tokens (or recompute after a preemption); samples when the prompt is done
    DECODE = "decode"  # exactly one token, always sampled
    # A reconstruction chunk (KVzip, engine/reconstruction_pass.py): computed after the sequence's context, its
    # attention to the context recorded, its KV rolled back; nothing sampled, the sequence's tokens unchanged.
    SCORE = "score"


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has no state for: admitted, re-admitted after a preemption, or forked."""

    request_id: str
    owner: int  # allocator owner id of its blocks
    sampling: SamplingParams
    kv_policy: KVPolicy
    token_ids: tuple[int, ...]  # prompt + output so far: the history logits processors see
    max_total_tokens: int
    sampler: Callable[[Any], Any] | None = None  # the caller's own logprobs -> token, else from `sampling`
    bound_cache: Any = None  # a caller's prompt cache the request runs on instead of arena blocks
    num_prompt_tokens: int | None = None  # how many of `token_ids` are prompt (None: all); a grammar replays the rest


@dataclass(frozen=True)
class ModelDraft:
    """Draft-model speculation for one decode item: the runner's draft model first sees `context` (the request's
    tokens from `start`, where its draft KV stops being valid, through the item's token), then drafts `k` tokens."""

    k: int
    start: int
    context: tuple[int, ...]


@dataclass(frozen=True)
class WorkItem:
    """What one request computes this step."""

    request_id: str
    kind: WorkKind
    token_ids: tuple[int, ...]  # empty: a decode of the runner's last (possibly unread) sample
    start: int  # logical position of the first token (tokens already computed)
    physical_start: int  # KV slot of the first token (below `start` once a policy evicted)
    block_table: tuple[int, ...]
    sample: bool  # the last token's logits are sampled (a decode, or the prompt's last chunk)
    alone: bool = False  # needs forward passes of its own (an evicting policy or a caller's cache)
    mixable: bool = True  # a prefill chunk that may ride in the decode forward (on the arena, no hook pending)
    # Speculative decoding: tokens proposed after `token_ids` (a decode of one known token). The runner computes
    # them in the same pass, keeps the longest prefix the model agrees with and samples one more token.
    draft: tuple[int, ...] = ()
    # Draft-model speculation (engine/draft_runner.py): on a decode item, the draft model proposes the tokens; on a
    # prefill item (k=0), it computes the chunk (and what it has not seen before it) in the same step.
    model_draft: ModelDraft | None = None
    compress: bool = False  # a SCORE item that ends its reconstruction: the policy then evicts to its budget

    @property
    def num_tokens(self) -> int:
        return (len(self.token_ids) or 1) + len(self.draft) + (self.model_draft.k if self.model_draft else 0)


@dataclass(frozen=True)
class StepPlan:
    new_requests: tuple[NewRequest, ...] = ()
    dropped: tuple[str, ...] = ()  # requests whose runner state goes (finished, aborted, preempted)
    copies: tuple[tuple[int, int], ...] = ()  # (source block, destination block), executed in order, first
    prefill: tuple[WorkItem, ...] = ()
    decode: tuple[WorkItem, ...] = ()
    num_blocks_used: int = 0  # one past the highest block id in use: the arena must back them
    # (block, payload) read back from the disk tier (kv/block_io.py layout), written before the copies
    restores: tuple[tuple[int, bytes], ...] = ()
    score: tuple[WorkItem, ...] = ()  # reconstruction chunks (WorkKind.SCORE), each in a pass of its own

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode or self.score)


@dataclass(frozen=True)
class SampledToken:
    """A token the runner sampled. `ready`: evaluated now (a prompt finished in a pass of its own); otherwise
    still being computed (a decode launched asynchronously), read by the next step. A verified draft gives
    several: `token` `[n]` and `logprobs` `[n, V]` (the accepted drafted tokens, then the one sampled after them)."""

    request_id: str
    token: Any  # mx.array [1] (or [n], a verified draft) of an integer dtype
    logprobs: Any  # mx.array [V] (or [n, V])
    ready: bool


@dataclass(frozen=True)
class StepResult:
    sampled: tuple[SampledToken, ...] = ()
    # Physical KV length of each request whose policy evicted or compressed this step (the block manager trims
    # its table to it); requests absent here hold exactly what the plan wrote.
    physical: Mapping[str, int] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)  # request id -> why it failed (it alone ends)
    # Diagnostics for the adaptive prefill budget: prompt tokens in passes of their own and their seconds, and the
    # decode forward's seconds (with `mixed_tokens` prompt tokens packed into it).
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    mixed_tokens: int = 0
    decode_seconds: float | None = None
    # request id -> how many of its drafted tokens were accepted (every request that had a draft this step)
    accepted: Mapping[str, int] = field(default_factory=dict)
    # Draft-model passes this step (engine/draft_runner.py): their seconds (within the step's time), how many passes
    # and the sequences drafting in them; the verify-cost estimate counts them as their own term.
    draft_seconds: float = 0.0
    draft_passes: int = 0
    draft_sequences: int = 0
