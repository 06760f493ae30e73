"""A `StepPlan` as the other ranks receive it, and what cannot be sent.

Almost all of a plan is plain data already. What is not:

- a seeded request's sampler (engine/seeded.py) is a closure whose key advances per draw: it goes as a
  `SeededSamplerRef` (a serial number per closure), and each rank keeps one closure per serial, built from the
  request's seed, so every rank draws the same tokens, also after a preempted request is re-admitted;
- a request sampled without a seed draws from MLX's global random state: rank 0 picks a seed for each step that
  samples such a request and every rank seeds with it before running the step (`PlanEncoder.encode`'s flag);
- a caller's own sampler callable, a caller's prompt cache and disk-tier restores (rank 0's disk holds only its own
  KV heads) cannot be sent: refused with a DistributedError naming the option;
- a draft-model item (`WorkItem.model_draft`) is plain data: every rank runs it with its own whole copy of the draft
  model (leader.py), drawing sampled drafts from the step's seed like any unseeded draw;
- KV policies decide on each rank from what that rank sees. Policies that decide from positions alone (StreamingLLM's
  sinks + window) make the same choice on every rank. Policies that select per KV head (`selects_per_head`: H2O,
  Expected Attention, D2O, SnapKV, KVzip) do too: each rank holds whole KV heads and the query heads of their GQA
  groups, so each head keeps the slots it keeps in one process, and the count kept, fixed by the budget, is the same
  on every head and rank (so are the block tables). KVzip's reconstruction chunks are plan items (`StepPlan.score`)
  every rank runs, each head's scores coming from its own group's queries. Merging policies that merge per KV head
  (`merges_per_head`: mean pooling, token merging) pick their ranges from the lengths and the mass, the same on every
  rank, and build each head's slots from that head alone. Refused: policies that share one selection across a
  layer's heads, keep a count that depends on score values, merge with weights tied to the model's KV head count
  (the learned compressor and sidecar, which a rank's head count would pick wrongly), and any not declared per head.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

from cortexstream.distributed.errors import DistributedError
from cortexstream.engine import seeded
from cortexstream.engine.step_plan import NewRequest, StepPlan
from cortexstream.policies.base import KVPolicy

# Capabilities of a policy whose eviction depends on what one rank's heads see.
RANK_LOCAL_CAPABILITIES = ("needs_attention_scores", "needs_query_statistics", "merges", "merges_evicted",
                           "uses_logit_bias", "reconstructs")
# Merging slots (and their logit biases): allowed only for a policy that declares its merges per head.
SLOT_MERGING_CAPABILITIES = ("merges", "uses_logit_bias")


def policy_problem(policy: KVPolicy) -> str | None:
    """Why `policy` cannot run on several ranks, or None."""
    local = [name for name in RANK_LOCAL_CAPABILITIES if getattr(policy, name, False)]
    if getattr(policy, "observation_window", None) is not None:
        local.append("observation_window")
    if not policy.evicts or not local:
        return None
    merging = [name for name in local if name in SLOT_MERGING_CAPABILITIES]
    selecting = [name for name in local if name not in SLOT_MERGING_CAPABILITIES]
    whys = []
    if merging and not policy.merges_per_head:
        whys.append("merges slots without declaring a per-head merge (merges_per_head): its merge may mix heads "
                    "or use weights made for the model's full KV head count (the learned compressor and sidecar)")
    if selecting and not policy.selects_per_head:
        whys.append("does not declare a per-head selection (selects_per_head)")
    if policy.pools_heads:
        whys.append("shares each layer's budget across KV heads that live on different ranks (pools_heads)")
    if not whys:
        return None
    return (f"kv_policy {policy.describe()!r} decides what to keep from what each rank's own KV heads see "
            f"({', '.join(local)}) and {' and '.join(whys)}, so the ranks could keep different tokens; use a "
            "policy that selects per KV head (h2o, expected, d2o, snapkv, kvzip), one that merges per KV head "
            "(meanpool, tome), a position-based one (streaming) or none on several ranks")


def is_seeded_sampler(sampler: Any) -> bool:
    """Whether `sampler` is a closure made by engine.seeded.seeded_sampler (rebuilt from the seed on each rank)."""
    return (getattr(sampler, "__module__", None) == seeded.__name__
            and getattr(sampler, "__qualname__", "").startswith(seeded.seeded_sampler.__qualname__ + "."))


@dataclass(frozen=True)
class SeededSamplerRef:
    serial: int  # one per closure on rank 0: a re-admitted request continues its key where it stopped


class PlanEncoder:
    """Rank 0's side: plans made sendable, or refused."""

    def __init__(self) -> None:
        self._serials: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._next_serial = 1
        self._unseeded: set[str] = set()  # requests drawing from MLX's global random state

    def encode(self, plan: StepPlan) -> tuple[StepPlan, bool]:
        """The plan to send, and whether this step draws from the global random state (then every rank seeds)."""
        if plan.restores:
            raise DistributedError("kv_disk: disk-tier restores cannot run on several ranks (each rank's KV holds "
                                   "only its heads); start without --kv-disk")
        for request_id in plan.dropped:
            self._unseeded.discard(request_id)
        news = tuple(self._encode_request(spec) for spec in plan.new_requests)
        items = plan.prefill + plan.decode
        random = any(item.request_id in self._unseeded and (item.sample or item.draft) for item in items)
        return replace(plan, new_requests=news), random

    def _encode_request(self, spec: NewRequest) -> NewRequest:
        if spec.bound_cache is not None:
            raise DistributedError(f"request {spec.request_id!r}: prompt_cache (a caller's own cache) cannot run "
                                   "on several ranks; use the engine's arena")
        problem = policy_problem(spec.kv_policy)
        if problem is not None:
            raise DistributedError(f"request {spec.request_id!r}: {problem}")
        sampler: Any = spec.sampler
        if sampler is None:
            if not spec.sampling.greedy:
                self._unseeded.add(spec.request_id)
            return spec
        if not is_seeded_sampler(sampler):
            raise DistributedError(f"request {spec.request_id!r}: sampler (a caller's own callable) cannot run on "
                                   "several ranks; use the sampling parameters (temperature, top_p, seed, ...)")
        serial = self._serials.get(sampler)
        if serial is None:
            serial = self._serials[sampler] = self._next_serial
            self._next_serial += 1
        return replace(spec, sampler=SeededSamplerRef(serial))


class PlanDecoder:
    """The other ranks' side: each `SeededSamplerRef` back to a seeded closure (the same one per serial)."""

    def __init__(self, keep: int = 4096) -> None:
        self._samplers: "OrderedDict[int, Callable[[Any], Any]]" = OrderedDict()
        self._keep = keep  # closures kept for re-admitted requests (the oldest go first)

    def decode(self, plan: StepPlan) -> StepPlan:
        if not any(isinstance(spec.sampler, SeededSamplerRef) for spec in plan.new_requests):
            return plan
        return replace(plan, new_requests=tuple(self._decode_request(spec) for spec in plan.new_requests))

    def _decode_request(self, spec: NewRequest) -> NewRequest:
        ref = spec.sampler
        if not isinstance(ref, SeededSamplerRef):
            return spec
        sampler = self._samplers.get(ref.serial)
        if sampler is None:
            if spec.sampling.seed is None:
                raise DistributedError(f"request {spec.request_id!r}: a seeded sampler without a seed")
            sampler = self._samplers[ref.serial] = seeded.seeded_sampler(spec.sampling, spec.sampling.seed)
            while len(self._samplers) > self._keep:
                self._samplers.popitem(last=False)
        self._samplers.move_to_end(ref.serial)
        return replace(spec, sampler=sampler)
