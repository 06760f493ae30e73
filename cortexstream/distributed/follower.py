"""What every rank but 0 does: run rank 0's plans on its own shard of the model until rank 0 says stop.

Per `OpenEngine` a rank builds what the engine on rank 0 has beside its scheduler: an arena of the same layout
(holding only this rank's KV heads), the compute backend with the same small-batch setting, a grammar compiler,
the draft model when rank 0's engine has one (loaded whole from the source rank 0 names, checked against the
target as rank 0 checked it, its drafts compared with every rank's: draft_agreement.py) and a `ModelRunner`.
Each `RunStep` is executed as rank 0's engine executes it (the sharded model's all-sums pair the ranks' forward
passes), with the step's random seed when it has one. Sampling is the same everywhere (the
logits after the last all-sum are the same on every rank), and a decode item that carries the token rank 0 read
is checked against the token this rank sampled: a difference stops the ranks with an error naming both. So is a
request whose KV policy evicts: the KV slots each plan says it starts from (what rank 0's policy left) must be
what this rank's policy left, since rank 0 allocates the blocks for every rank. Reconstruction chunks (KVzip's
`StepPlan.score` items) count as such items: each leaves the context's slots (its own K/V rolled back), the last one
the slots the policy kept.

A rank answers each message with the last step it has computed (the previous step's tokens are evaluated when the
next message is handled, so a rank builds the next step while its last one computes, as rank 0 does). A watchdog
thread ends the process with a clear error when one step takes longer than `timeout` (this rank waits in an MLX
collective for a rank that hangs: such a wait cannot be interrupted).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

import mlx.core as mx

from cortexstream.backend import ComputeBackend
from cortexstream.distributed.draft_agreement import DraftAgreement
from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.follower_channel import FollowerChannel, LeaderState
from cortexstream.distributed.ledger import BlockLedger
from cortexstream.distributed.messages import CloseEngine, Heartbeat, OpenEngine, RunStep, Stop
from cortexstream.distributed.plan_wire import PlanDecoder
from cortexstream.engine.draft_runner import DraftRunner
from cortexstream.engine.runner import ModelRunner
from cortexstream.engine.step_plan import StepPlan, StepResult
from cortexstream.grammar.compiler import GrammarCompiler
from cortexstream.kv.arena import KVArena
from cortexstream.models.eos import eos_ids


def load_draft(source: str, model: Any, tokenizer: Any, arena: KVArena, rank: int) -> DraftRunner:
    """The draft model rank 0's engine runs, loaded whole on this rank, or DistributedError saying why not."""
    try:
        return DraftRunner.load(source, model, tokenizer, arena)
    except Exception as exc:  # noqa: BLE001 - a missing file, a hub error, a refused pair: all end the session
        raise DistributedError(f"rank {rank}: speculative: cannot load the draft model {source!r} on this rank "
                               f"({type(exc).__name__}: {exc}); every rank loads the draft model whole from the "
                               "source rank 0 names, so it must be there on every rank (the same path, relative "
                               "to each rank's working directory, or a hub id)") from exc


class RankEngine:
    """One engine's runner on this rank."""

    def __init__(self, model: Any, tokenizer: Any, spec: OpenEngine, rank: int,
                 agreement: DraftAgreement | None = None) -> None:
        # Key centers come from this rank's own heads (kv_center.py), not rank 0's.
        self.arena = KVArena(spec.arena.with_key_centers(model) if spec.arena.key_centers is not None else spec.arena)
        drafter = None if spec.draft_model is None else load_draft(spec.draft_model, model, tokenizer, self.arena,
                                                                   rank)
        if drafter is not None:
            drafter.agree_with(agreement)
        self.backend = ComputeBackend.for_engine(spec.small_batch_rows, model=model)
        self.runner = ModelRunner(model, self.arena, self.backend, batch_prefill=spec.batch_prefill,
                                  mixed_prefill=spec.mixed_prefill,
                                  constraints=GrammarCompiler(tokenizer, eos_ids(tokenizer)).constraint,
                                  drafter=drafter)

    def execute(self, plan: StepPlan) -> StepResult:
        """As `Engine.step` runs a plan: the backend held for the step, and past it while a pass is in flight."""
        self.backend.begin_step()
        in_flight = False
        try:
            result = self.runner.execute(plan)
            in_flight = any(not sampled.ready for sampled in result.sampled)
            return result
        finally:
            self.backend.end_step(in_flight)

    def close(self) -> None:
        self.backend.close()


class Follower:
    def __init__(self, model: Any, tokenizer: Any, channel: FollowerChannel) -> None:
        self.model, self.tokenizer, self.channel = model, tokenizer, channel
        self.rank, self.timeout = channel.rank, channel.timeout
        self._engines: dict[int, RankEngine] = {}
        self._decoder = PlanDecoder()
        self.ledger = BlockLedger()  # every block operation this rank executed (reported to rank 0 at Stop)
        self._last: dict[str, mx.array] = {}  # request id -> the token this rank sampled last for it (lazy)
        self._evicting: set[str] = set()  # requests whose KV policy evicts
        self._physical: dict[str, int] = {}  # such a request -> KV slots this rank left it at its last step
        self._pending: tuple[int, list[mx.array]] | None = None  # (step, its tokens) not yet evaluated
        self.done = 0  # every step up to this one is computed
        self._busy_since: float | None = None
        self._running = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="rank-step-watchdog")
        # Called with every step's result (its tokens still lazy), e.g. to compare a rank's tokens with rank 0's.
        self.on_result: Callable[[StepResult], None] | None = None

    def run(self) -> None:
        """Follow rank 0 until it says stop. Raises DistributedError when rank 0 stopped with an error, went away
        or the ranks diverged (rank 0 is told why first)."""
        self._running.set()
        self._watchdog.start()
        try:
            while True:
                message = self.channel.receive()
                self._busy_since = time.monotonic()
                stop = self._handle(message)
                self._busy_since = None
                if stop:
                    return
        except Exception as exc:
            reason = str(exc) if isinstance(exc, DistributedError) else f"rank {self.rank}: {type(exc).__name__}: {exc}"
            if not isinstance(exc, DistributedError) and self.channel.leader_state() is LeaderState.GONE:
                reason = f"rank {self.rank}: rank 0 closed the connection: its process has ended ({reason})"
            self.channel.fail(reason)
            raise DistributedError(reason) from exc
        finally:
            self._busy_since = None
            self._running.clear()
            for engine in self._engines.values():
                engine.close()
            self._engines.clear()

    def _handle(self, message: Any) -> bool:
        if isinstance(message, RunStep):
            self._step(message)
        elif isinstance(message, OpenEngine):
            agreement = None if message.draft_model is None else DraftAgreement(self.channel.group.group,
                                                                                 self.channel.group.size)
            self._engines[message.engine_id] = RankEngine(self.model, self.tokenizer, message, self.rank, agreement)
        elif isinstance(message, CloseEngine):
            self._settle()
            engine = self._engines.pop(message.engine_id, None)
            if engine is not None:
                engine.close()
        elif isinstance(message, Stop):
            self._settle()
            if message.error is not None:
                raise DistributedError(f"rank 0 stopped: {message.error}")
            self.channel.ack(self.done, self.ledger.digest())
            return True
        elif isinstance(message, Heartbeat):
            self._settle()
        else:
            raise DistributedError(f"rank {self.rank}: unknown message {type(message).__name__} from rank 0")
        self.channel.ack(self.done)
        return False

    def _step(self, message: RunStep) -> None:
        engine = self._engines.get(message.engine_id)
        if engine is None:
            raise DistributedError(f"rank {self.rank}: step {message.step} for engine {message.engine_id}, "
                                   "which rank 0 never opened")
        plan = self._decoder.decode(message.plan)
        self._check(plan)
        self.ledger.apply(plan, message.engine_id)
        for request_id in plan.dropped:
            self._last.pop(request_id, None)
        for spec in plan.new_requests:
            self._last.pop(spec.request_id, None)
        if message.seed is not None:
            mx.random.seed(message.seed)
        result = engine.execute(plan)
        self._record_physical(plan, result)
        self._settle()
        tokens = []
        for sampled in result.sampled:
            self._last[sampled.request_id] = sampled.token
            tokens.append(sampled.token)
        self._pending = (message.step, tokens)
        if self.on_result is not None:
            self.on_result(result)

    def _check(self, plan: StepPlan) -> None:
        """Each decode item that names its input token (the token rank 0 read) against this rank's sample, and
        each item of a request with an evicting KV policy: the KV slots it starts from (`physical_start`, what
        rank 0's policy left) against what this rank's left, since rank 0's block tables assume every rank kept
        as many."""
        for request_id in (*plan.dropped, *(spec.request_id for spec in plan.new_requests)):
            self._physical.pop(request_id, None)
            self._evicting.discard(request_id)
        self._evicting.update(spec.request_id for spec in plan.new_requests if spec.kv_policy.evicts)
        for item in (*plan.prefill, *plan.decode, *plan.score):
            mine = self._physical.pop(item.request_id, None)
            if mine is not None and mine != item.physical_start:
                raise DistributedError(f"rank {self.rank} kept {mine} KV slots for request {item.request_id!r} "
                                       f"where rank 0 kept {item.physical_start}: the ranks evicted differently")
        for item in plan.decode:
            mine = self._last.get(item.request_id)
            if not item.token_ids or mine is None:
                continue
            token = int(mine.reshape(-1)[-1].item())
            if token != item.token_ids[0]:
                raise DistributedError(f"rank {self.rank} sampled token {token} for request {item.request_id!r} "
                                       f"where rank 0 sampled {item.token_ids[0]}: the ranks diverged")

    def _record_physical(self, plan: StepPlan, result: StepResult) -> None:
        """The KV slots each evicting request holds after this step (what it wrote, less what its policy removed;
        a reconstruction chunk reports what its rollback and compression left)."""
        for item in (*plan.prefill, *plan.decode, *plan.score):
            if item.request_id in self._evicting and not item.draft and item.model_draft is None:
                self._physical[item.request_id] = result.physical.get(item.request_id,
                                                                      item.physical_start + item.num_tokens)

    def _settle(self) -> None:
        """Evaluate the last step's tokens; it is then computed."""
        if self._pending is not None:
            step, tokens = self._pending
            mx.eval(tokens)
            self._pending, self.done = None, step

    def _watch(self) -> None:
        while self._running.is_set():
            time.sleep(min(self.timeout / 4, 0.5))
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout:
                # Rank 0 sends a heartbeat at least every timeout / 4 while it runs, so nothing waiting to be read
                # now means it stopped too; messages waiting mean it is alive and another rank is the one.
                state = self.channel.leader_state()
                suspect = {LeaderState.SILENT: "rank 0 has sent nothing either: rank 0 hangs",
                           LeaderState.GONE: "rank 0 closed the connection: its process has ended",
                           LeaderState.SENT: "rank 0 is alive: another rank died or hangs"}[state]
                reason = (f"rank {self.rank}: a step waited {self.timeout:g} s in the model's collectives; {suspect}")
                self.channel.fail(reason)
                print(f"cortexstream: error: {reason}", file=sys.stderr, flush=True)
                os._exit(1)
