"""Rank 0's side: engines attached to the other ranks, every plan sent before rank 0's runner executes it.

`attach(engine)` checks that the engine can run on several ranks, tells the ranks to build the same runner over
an arena of the same layout, and installs itself as the engine's `plan_listener`: the scheduler keeps deciding on
rank 0 alone, and each plan reaches every rank (plan_wire.py) before rank 0 runs it. What is refused, and why, is
listed in plan_wire.py and `engine_problem`.

An engine with a draft model (draft-model speculation) sends its source: every rank loads the draft model whole
and drafts on the same inputs, and each drafting pass's drafts are compared across the ranks before the target
verifies them (draft_agreement.py). `attach` waits until every rank has loaded it, so a draft model that only rank 0
can load ends the session with the rank's error at once.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import mlx.core as mx

from cortexstream.distributed.draft_agreement import DraftAgreement
from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.leader_channel import LeaderChannel
from cortexstream.distributed.ledger import BlockLedger
from cortexstream.distributed.messages import CloseEngine, OpenEngine, RunStep
from cortexstream.distributed.plan_wire import PlanEncoder, policy_problem
from cortexstream.engine.step_plan import StepPlan


def engine_problem(engine: Any) -> str | None:
    """Why `engine`, as built, cannot run on several ranks, or None."""
    if engine.disk is not None:
        return "kv_disk: the disk tier cannot run on several ranks yet (each rank's KV holds only its heads)"
    problem = policy_problem(engine.kv_policy)
    if problem is not None:
        return problem
    if engine.plan_listener is not None:
        return "the engine already has a plan_listener (one engine is attached once)"
    return None


class _Relay:
    """One attached engine's plan listener."""

    def __init__(self, leader: "DistributedLeader", engine_id: int) -> None:
        self.leader, self.engine_id = leader, engine_id

    def __call__(self, plan: StepPlan) -> None:
        self.leader.relay(self.engine_id, plan)

    def policy_problem(self, policy: Any) -> str | None:
        """Why a request with KV policy `policy` cannot run on these ranks, or None (a server refuses that request
        alone, before it reaches the scheduler)."""
        return policy_problem(policy)


class DistributedLeader:
    def __init__(self, channel: LeaderChannel) -> None:
        self.channel = channel
        self._encoder = PlanEncoder()
        self._next_engine = 1
        self.steps = 0  # RunStep messages sent
        self.relay_seconds = 0.0  # time spent encoding and sending plans (rank 0's cost of having other ranks)
        self.ledger = BlockLedger()  # every block operation sent (the other ranks report theirs at shutdown)

    def attach(self, engine: Any) -> Any:
        """Run `engine` on every rank from now on (before its first step); returns it. DistributedError when it
        cannot (see `engine_problem`)."""
        problem = engine_problem(engine)
        if problem is not None:
            raise DistributedError(f"cannot run this engine on {self.channel.group.size} ranks: {problem}")
        engine_id, self._next_engine = self._next_engine, self._next_engine + 1
        runner = engine.runner
        drafter = runner.drafter
        self.channel.send(OpenEngine(engine_id, engine.arena.config, runner.batch_prefill, runner.mixed_prefill,
                                     getattr(engine.backend, "small_batch_rows", 0),
                                     None if drafter is None else drafter.source))
        if drafter is not None:
            self.channel.wait_answered()  # every rank loaded the draft model (or the session failed, saying why)
            drafter.agree_with(DraftAgreement(self.channel.group.group, self.channel.group.size))
        engine.plan_listener = _Relay(self, engine_id)
        return engine

    def detach(self, engine: Any) -> None:
        """Stop running `engine` on the other ranks (they free its arena)."""
        relay = engine.plan_listener
        if isinstance(relay, _Relay) and relay.leader is self:
            engine.plan_listener = None
            if engine.runner.drafter is not None:
                engine.runner.drafter.agree_with(None)
            self.channel.send(CloseEngine(relay.engine_id))

    def stats(self) -> dict[str, float]:
        """Counters of the plans sent so far: steps, seconds and bytes spent relaying them, mean ms per step."""
        return {"steps": self.steps, "relay_seconds": self.relay_seconds, "bytes_sent": self.channel.bytes_sent,
                "relay_ms_per_step": 1000 * self.relay_seconds / self.steps if self.steps else 0.0}

    def relay(self, engine_id: int, plan: StepPlan) -> None:
        """Send one plan to every rank, then seed this rank as they will (when the step draws at random)."""
        start = time.perf_counter()
        self.ledger.apply(plan, engine_id)
        wire, random = self._encoder.encode(plan)
        seed = secrets.randbits(63) if random else None
        self.steps += 1
        self.channel.send(RunStep(engine_id, self.steps, wire, seed))
        self.relay_seconds += time.perf_counter() - start
        if seed is not None:
            mx.random.seed(seed)
