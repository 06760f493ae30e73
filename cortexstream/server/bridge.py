"""The boundary between the engine thread and the asyncio event loop.

The engine runs on `ThreadedEngine`'s thread. Tokens come back through its `on_step` hook: after every engine
step the hook turns that step's outputs into `TokenEvent`s and hands them all to the event loop with ONE
`loop.call_soon_threadsafe`, whatever the number of requests, instead of one thread hop per token per request
(`handoff="per_token"` keeps the latter only for the diagnostic that measures the difference). Requests go the
other way in batches too: jobs are queued under a lock and one `ThreadedEngine.call` adds every job queued
since the last one, so a burst of arrivals costs one engine-thread round trip, and the event loop never blocks
on the engine (the round trip waits in a one-thread executor).

Log-probabilities are read on the engine thread (MLX arrays are never touched by the event loop), for the
requests that asked for them only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.engine.client import ThreadedClient
from cortexstream.engine.engine import Engine, RequestOutput
from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.fork import child_sampling
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.threaded import ThreadedEngine
from cortexstream.errors import CortexStreamError
from cortexstream.server.config import Handoff, parse_handoff
from cortexstream.server.errors import APIError
from cortexstream.server.jobs import EngineJob, RequestHandle, TokenEvent, Tracked

# Re-exported: the server's modules take these from here or from `jobs`.
__all__ = ["EventLoopBridge", "EngineJob", "RequestHandle", "TokenEvent"]

StepListener = Callable[[Engine], None]


class EventLoopBridge:
    """Carries jobs from the event loop to the engine thread and each step's token events back (see the module
    docstring)."""

    def __init__(self, engine: Engine, handoff: Handoff | str = Handoff.PER_STEP,
                 on_events: Callable[[RequestHandle, TokenEvent], None] | None = None) -> None:
        self.engine = engine
        self.handoff = parse_handoff(handoff)
        self.on_events = on_events  # event-loop callback per delivered event (metrics)
        # The bridge talks to the engine through the EngineClient protocol (push mode: outputs arrive at
        # _on_step); requests are added by `call` in batches, so per-request streams are never opened.
        self.client = ThreadedClient(ThreadedEngine(engine, on_step=self._on_step, on_failure=self._on_failure),
                                     start=False)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.step_listeners: list[StepListener] = []  # engine thread, after each step (stats snapshots)
        self._lock = threading.Lock()
        self._pending: list[tuple[EngineJob, asyncio.Future]] = []
        self._drain_scheduled = False
        self._cancelled: set[str] = set()
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cortexstream-submit")
        self._handles: dict[str, tuple[RequestHandle, int]] = {}  # event loop only
        self._tracked: dict[str, Tracked] = {}  # engine thread only
        self.owner_tenants: dict[int, str | None] = {}  # Sequence.owner -> tenant label, for /v1/kv
        self._finished_since_prune = 0
        self.failure: str | None = None  # why the engine can no longer serve (set by `fail`), or None

    # --- life cycle -------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.client.start()

    def stop(self) -> None:
        self.client.close()
        self._submitter.shutdown(wait=False, cancel_futures=True)

    @property
    def engine_running(self) -> bool:
        return self.failure is None and self.client.threaded.running

    def fail(self, reason: str) -> None:
        """Any thread: the engine can no longer serve (e.g. a distributed rank died, and the engine thread may be
        stuck in a collective). From now on /health and new requests answer 503 with `reason`; every open request
        ends with that error now, without waiting for the engine thread."""
        self.failure = reason
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._fail_all, APIError(503, reason, code="engine_failed"))

    def policy_problem(self, policy: Any) -> str | None:
        """Why this engine cannot run a request with KV policy `policy`, or None: asked of the engine's plan
        listener when it has a say (a distributed leader's relay refuses policies the ranks cannot share)."""
        ask = getattr(self.engine.plan_listener, "policy_problem", None)
        return ask(policy) if callable(ask) else None

    @property
    def num_active(self) -> int:
        return len({id(handle) for handle, _ in self._handles.values()})

    # --- submission (event loop) ------------------------------------------------------------------------------
    async def submit(self, job: EngineJob) -> RequestHandle:
        """Queue a job; returns once the engine holds it. Engine-side argument errors are raised here."""
        assert self.loop is not None, "EventLoopBridge.start() was not called"
        if not self.engine_running:
            raise CortexStreamError("the engine thread is not running")
        handle = RequestHandle(job, time.perf_counter())
        for index, rid in enumerate(job.request_ids):
            self._handles[rid] = (handle, index)
        accepted = self.loop.create_future()
        with self._lock:
            self._pending.append((job, accepted))
            schedule = not self._drain_scheduled
            self._drain_scheduled = True
        if schedule:
            self.loop.run_in_executor(self._submitter, self._call_add_pending)
        try:
            error = await accepted
        except asyncio.CancelledError:
            self.abort(handle)
            raise
        if error is not None:
            self._forget(handle)
            raise error
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop every unfinished completion of `handle`; its blocks return to the arena within one step."""
        rids = [rid for i, rid in enumerate(handle.job.request_ids) if i in handle.unfinished]
        with self._lock:
            self._cancelled.update(rids)
        handle.aborted = True  # its remaining events still come (for the metrics), but nobody reads them
        for rid in rids:
            self.client.abort(rid)

    def _forget(self, handle: RequestHandle) -> None:
        for rid in handle.job.request_ids:
            self._handles.pop(rid, None)

    # --- engine thread ----------------------------------------------------------------------------------------
    def _add_pending(self, engine: Engine) -> None:
        with self._lock:
            jobs, self._pending = self._pending, []
            self._drain_scheduled = False
        for job, accepted in jobs:
            error: BaseException | None = None
            if self._take_cancelled(job.request_ids[0]):
                with self._lock:
                    self._cancelled.difference_update(job.request_ids)
                self._post_aborted(job.request_ids)
            else:
                try:
                    self._add_job(engine, job)
                except Exception as exc:  # noqa: BLE001 - reported to the request that caused it
                    error = exc
            self.loop.call_soon_threadsafe(_resolve, accepted, error)

    def _call_add_pending(self) -> None:
        """Submitter thread: one engine-thread round trip for every job queued so far."""
        try:
            self.client.call(self._add_pending)
        except Exception as exc:  # noqa: BLE001 - the engine thread is gone: fail the jobs it never took
            with self._lock:
                jobs, self._pending = self._pending, []
                self._drain_scheduled = False
            for _job, accepted in jobs:
                self.loop.call_soon_threadsafe(_resolve, accepted, CortexStreamError(f"engine unavailable: {exc}"))

    def _take_cancelled(self, rid: str) -> bool:
        """Whether `rid` was aborted before the engine got it (forgotten once asked)."""
        with self._lock:
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                return True
        return False

    def _skip_child(self, rid: str) -> bool:
        """Fork time: a child whose client already left is not created, and is reported aborted."""
        if not self._take_cancelled(rid):
            return False
        self._tracked.pop(rid, None)
        self._post_aborted([rid])
        return True

    def _post_aborted(self, rids: list[str]) -> None:
        now = time.perf_counter()
        self.loop.call_soon_threadsafe(
            self._deliver, [(rid, TokenEvent(-1, None, "", FinishReason.ABORTED, None, now)) for rid in rids])

    def _add_job(self, engine: Engine, job: EngineJob) -> None:
        def track(rid: str, index: int, seq: Sequence | None) -> None:
            self._tracked[rid] = Tracked(index, job.top_logprobs, seq)
            if seq is not None:
                self.owner_tenants[seq.owner] = job.tenant

        if job.fork:
            parent = engine.fork(
                job.prompt_tokens, job.sampling, job.request_ids, kv_policy=job.kv_policy,
                tenant=job.tenant, skip_child=self._skip_child, speculative=job.speculative,
                on_child=lambda rid, seq: self._adopt_child(rid, seq),
            )
            track(job.request_ids[0], 0, parent)
            self._tracked[job.request_ids[0]].siblings = list(job.request_ids[1:])
            for index, rid in enumerate(job.request_ids[1:], start=1):
                self._tracked[rid] = Tracked(index, job.top_logprobs)
            return
        for index, rid in enumerate(job.request_ids):
            sampling = child_sampling(job.sampling, index)
            engine.add_request(job.prompt_tokens, sampling, kv_policy=job.kv_policy, tenant=job.tenant,
                               request_id=rid, speculative=job.speculative)
            track(rid, index, engine.lookup(rid))

    def _adopt_child(self, rid: str, seq: Sequence) -> None:
        tracked = self._tracked.get(rid)
        if tracked is not None:
            tracked.sequence = seq
            self.owner_tenants[seq.owner] = self.owner_tenants.get(seq.owner, seq.tenant)
        for parent in self._tracked.values():
            if rid in parent.siblings:
                parent.siblings.remove(rid)

    def _on_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for listener in self.step_listeners:
            listener(engine)
        if not outputs:
            return
        wanted = [(out, self._tracked.get(out.request_id)) for out in outputs]
        lazy = [out.logprobs for out, tracked in wanted
                if tracked is not None and tracked.top_logprobs is not None and out.logprobs is not None]
        if lazy:
            mx.eval(lazy)
        events: list[tuple[str, TokenEvent]] = []
        for out, tracked in wanted:
            if tracked is None:
                continue
            events.append((out.request_id, self._event(out, tracked, now)))
            if out.finished:
                self._finished_since_prune += 1
                del self._tracked[out.request_id]
                with self._lock:
                    self._cancelled.discard(out.request_id)
                for sibling in tracked.siblings:  # ended before it could fork: its children end with it
                    if self._tracked.pop(sibling, None) is not None:
                        reason = (FinishReason.ERROR if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                                  else out.finish_reason)
                        events.append((sibling, TokenEvent(-1, None, "", reason, out.error or
                                                           "the shared prompt ended before forking", now)))
        if self._finished_since_prune >= _PRUNE_EVERY:
            self._prune_owner_tenants(engine)
        if not events:
            return
        if self.handoff == Handoff.PER_TOKEN:
            for event in events:
                self.loop.call_soon_threadsafe(self._deliver, [event])
        else:
            self.loop.call_soon_threadsafe(self._deliver, events)

    def _prune_owner_tenants(self, engine: Engine) -> None:
        """Forget the tenants of sequences that no longer own any block (cached blocks keep theirs)."""
        self._finished_since_prune = 0
        owners = set(np.unique(engine.snapshot().block_owners).tolist())
        self.owner_tenants = {o: t for o, t in self.owner_tenants.items() if o in owners}

    def _on_failure(self, exc: BaseException) -> None:
        """The engine step failed and ThreadedEngine aborted everything: fail every request still open."""
        self._tracked.clear()
        error: BaseException = CortexStreamError(f"engine step failed: {type(exc).__name__}: {exc}")
        if self.failure is not None:  # the step failed because the engine was declared failed: say why
            error = APIError(503, self.failure, code="engine_failed")
        self.loop.call_soon_threadsafe(self._fail_all, error)

    def _fail_all(self, error: BaseException) -> None:
        for handle, _ in list(self._handles.values()):
            handle.events.put_nowait(error)
        self._handles.clear()

    def _event(self, out: RequestOutput, tracked: Tracked, now: float) -> TokenEvent:
        cached = None
        if not tracked.started and (out.token is not None or out.finished):
            tracked.started = True
            cached = tracked.sequence.num_cached_prefix if tracked.sequence is not None else 0
        logprob, top = None, ()
        if tracked.top_logprobs is not None and out.logprobs is not None and out.token is not None:
            logprobs = out.logprobs
            logprob = float(logprobs[out.token].item())
            k = tracked.top_logprobs
            if k > 0:
                best = mx.argpartition(-logprobs, kth=k - 1)[:k]
                values = logprobs[best].tolist()
                top = tuple(sorted(zip(best.tolist(), values), key=lambda pair: -pair[1]))
        return TokenEvent(tracked.index, out.token, out.text, out.finish_reason, out.error, now, logprob, top,
                          cached, out.stop_string)

    # --- delivery (event loop) --------------------------------------------------------------------------------
    def _deliver(self, events: list[tuple[str, TokenEvent]]) -> None:
        for rid, event in events:
            entry = self._handles.get(rid)
            if entry is None:
                continue  # its client is gone
            handle, index = entry
            if event.index != index:
                event = replace(event, index=index)
            if event.finish_reason is not None:
                handle.unfinished.discard(index)
                self._handles.pop(rid, None)
            if self.on_events is not None:
                self.on_events(handle, event)
            if not handle.aborted:
                handle.events.put_nowait(event)


# Finished sequences between two prunings of owner_tenants (a pass over the block owners, about 1 ms per 1000
# blocks), so the map stays the size of the arena's owners instead of growing with every request served.
_PRUNE_EVERY = 2048


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
