"""What the runner keeps for one request between steps, and how a step's work item brings its KV view up to date.

The runner (engine/runner.py) holds one `RunnerRequest` per request a plan told it about (`NewRequest`): its
sampler, its managed view of the KV (whose table and counters come from each `WorkItem`), the policy state of an
evicting KV policy, and the token sampled last (possibly still lazy), which a pipelined decode item computes next.
It is a public type in a module of its own because the speculative verify pass (engine/verify_pass.py) runs outside
the runner and works on the same records as the runner's own passes: their fields, `step_kv`, and a decode batch's
input tokens (`decode_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.engine.policy_runtime import PolicyState
from cortexstream.engine.request_sampler import RequestSampler
from cortexstream.engine.step_plan import NewRequest, WorkItem
from cortexstream.kv.arena import KVArena
from cortexstream.kv.sequence_kv import SequenceKV


@dataclass
class RunnerRequest:
    """What the runner keeps for one request between steps."""

    spec: NewRequest
    sampler: RequestSampler
    kv: SequenceKV | None = None
    policy: PolicyState | None = None
    last: mx.array | None = None  # the token sampled last, possibly still lazy

    def step_kv(self, item: WorkItem, arena: KVArena, model: nn.Module) -> SequenceKV:
        """The request's KV view on `arena`, synced to the item's block table and counters; made on first use,
        with the policy state of an evicting policy (`model`: for a policy that re-rotates keys)."""
        kv = self.kv
        if kv is None:
            kv = self.kv = SequenceKV(arena, owner=self.spec.owner, contiguous=False, managed=True)
        kv.sync(item.block_table, item.physical_start, item.start)
        if self.policy is None and self.spec.kv_policy.evicts:
            self.policy = PolicyState.for_sequence(self.spec.kv_policy, kv, model)
            self.policy.expect_prompt_end(len(self.spec.token_ids))  # what its first prefill computes
        return kv


def decode_tokens(items: list[WorkItem], requests: Mapping[str, RunnerRequest]) -> mx.array:
    """The decode items' input tokens `[B, 1]` (a pipelined item's is its request's last, possibly lazy, sample)."""
    chosen = [requests[item.request_id] for item in items]
    if any(not item.token_ids for item in items):
        return mx.concatenate([
            request.last.astype(mx.uint32).reshape(1) if not item.token_ids
            else mx.array(item.token_ids, dtype=mx.uint32)
            for request, item in zip(chosen, items)
        ]).reshape(-1, 1)
    return mx.array(np.array([item.token_ids for item in items], dtype=np.uint32))


__all__ = ["RunnerRequest", "decode_tokens"]
