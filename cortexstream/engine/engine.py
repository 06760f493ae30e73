"""`Engine`: add_request / step / abort over the scheduler and the runner; step() = schedule -> run -> apply.

The scheduler owns every request's state and emits a `StepPlan`; the runner executes it and returns a `StepResult`;
the engine applies the result through the scheduler (tokens read, text and stop conditions, prefix-cache blocks,
finishing: engine/step_outputs.py) and hands back one `RequestOutput` per token. See engine/step_plan.py for the
contract.

Pipelined decode (`pipeline=True`, the default). Reading a sampled token (`.item()`) waits for the whole forward
pass, and building the next step's graph costs milliseconds of Python per step. So a decode step is launched
(`mx.async_eval`) on the previous step's sampled tokens while they are still lazy, and only then are those tokens
read and applied: graph building and applying overlap the computation, as in mlx-lm's `generate_step`. A
sampled-but-unread token is "in flight" (`Sequence.num_inflight`), and its output is emitted by the next `step()`.
When the previous token ends a request (eos, a stop string), the token launched after it is discarded (its request
is finished and its blocks freed); a request whose unread token is its last by `max_tokens` gets no further step.
Steps that could admit, prefill or preempt (waiting requests, a prompt in progress, few free blocks) first read
every token in flight (`Scheduler.may_pipeline`), so recompute-preemption never loses one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn

from cortexstream.backend import ComputeBackend
from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine import kv_edits
from cortexstream.engine.disk_tier import open_disk_tier
from cortexstream.engine.draft_runner import load_drafter
from cortexstream.engine.chunk_budget import AdaptivePrefillBudget
from cortexstream.engine.runner import ModelRunner
from cortexstream.engine.scheduler import Scheduler
from cortexstream.engine.scheduler_config import SchedulerConfig
from cortexstream.engine.sequence import Sequence, SequenceHook
from cortexstream.engine.snapshot import EngineView, engine_stats, take_snapshot
from cortexstream.engine.step_outputs import StepOutputs
from cortexstream.engine.step_plan import StepPlan, StepResult
from cortexstream.errors import GenerationError, InvalidArgumentError
from cortexstream.grammar.compiler import GrammarCompiler
from cortexstream.engine.single_thread import single_threaded
from cortexstream.engine.request_state import RequestOutput
from cortexstream.engine.request_intake import make_sequence, resolve_sampling
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.speculative_config import parse_speculative
from cortexstream.kv.arena import KVArena
from cortexstream.engine.sizing import engine_arena
from cortexstream.policies.parsing import parse_policy
from cortexstream.models.eos import eos_ids
from cortexstream.models.split_mark import split_ranks


class Engine:
    """Continuous-batching engine over one KV arena. Not thread-safe by itself: see `ThreadedEngine`."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        arena: KVArena | None = None,
        kv_tokens: int | None = None,
        kv_bytes: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 16,
        prefill_step_size: int = 512,
        prefill_tokens_while_decoding: int | str | None = "auto",
        prefix_caching: bool = True,
        kv_policy: Any = None,
        pipeline: bool = True,
        batch_prefill: bool = True,
        mixed_prefill: bool = True,
        small_batch_matmul: int | str = "auto",
        kv_dtype: str | None = None,
        kv_group_size: int | None = None,
        kv_disk: str | None = None,
        kv_disk_size: int | str = "20GiB",
        kv_disk_required: bool = True,
        speculative: Any = None,
    ) -> None:
        """`kv_disk`: a directory for the prefix cache's disk tier, `kv_disk_size` at most; if it cannot be used,
        `kv_disk_required` False runs without it (`disk_problem` says why) instead of raising. engine/disk_tier.py."""
        arena = engine_arena(model, arena, kv_tokens, kv_bytes, block_size, kv_dtype, kv_group_size)
        self.disk, self.disk_problem = open_disk_tier(model, arena, kv_disk, kv_disk_size, kv_disk_required)
        # Everything platform-specific (BLAS threads, the CPU small-batch kernel, attention strategies, Metal
        # kernels, SDPA routing) is behind this, chosen once; the step below never asks what platform it runs on.
        self.backend = ComputeBackend.for_engine(small_batch_matmul, model=model)
        self.model = model
        # Policy for requests that name none (a KVPolicy or a string such as 'h2o:budget=0.2').
        self.kv_policy = parse_policy(kv_policy)
        self.speculative = parse_speculative(speculative)  # default for requests that name none ("ngram:k=4")
        self.tokenizer = tokenizer
        self.arena = arena
        self.block_manager = BlockManager(arena.allocator, arena.config.block_size, prefix_caching,
                                          self.disk.namespace if self.disk else arena.config.cache_key,
                                          self.disk.prefix if self.disk else None)
        # "auto": chunks sized so that one costs about one decode step (see chunk_budget); an int: fixed.
        self._adaptive = None
        auto = prefill_tokens_while_decoding == "auto"
        if isinstance(prefill_tokens_while_decoding, str) and not auto:
            raise InvalidArgumentError(f"prefill_tokens_while_decoding: {prefill_tokens_while_decoding!r} must be "
                                       "'auto', None or an integer >= 1")
        config = SchedulerConfig(max_num_seqs, prefill_step_size, None if auto else prefill_tokens_while_decoding)
        if auto:  # built after the config checked prefill_step_size
            self._adaptive = AdaptivePrefillBudget(prefill_step_size)
            config = replace(config, prefill_tokens_while_decoding=self._adaptive.tokens())
        self.scheduler = Scheduler(self.block_manager, config)
        self._eos_ids = eos_ids(tokenizer)
        self.grammars = GrammarCompiler(tokenizer, self._eos_ids)  # response_format / grammar -> token masks
        self.runner = ModelRunner(model, arena, self.backend, batch_prefill=batch_prefill,
                                  mixed_prefill=mixed_prefill, constraints=self.grammars.constraint,
                                  drafter=load_drafter(self.speculative, model, tokenizer, arena))
        # Per-request text, tokens in flight, and the outputs results become (engine/step_outputs.py).
        self._outputs = StepOutputs(self.scheduler, self.block_manager, tokenizer, self._eos_ids)
        # Wall time spent in prefill chunks vs decode batches (each evaluated before the clock is read).
        self.prefill_time = 0.0
        self.decode_time = 0.0
        self.num_decode_tokens = 0
        self.pipeline = pipeline
        # Called with every plan before the runner executes it (a recorder, a replaying second runner).
        self.plan_listener: Callable[[StepPlan], None] | None = None
        self.split_ranks = split_ranks(model)  # > 1: only steps relayed to the other ranks may run

    # --- requests ---------------------------------------------------------------------------------------------
    @single_threaded
    def add_request(
        self,
        prompt: Any,
        sampling: SamplingParams | None = None,
        kv_policy: Any = None,
        tenant: str | None = None,
        request_id: str | None = None,
        prompt_cache: list[Any] | None = None,
        sampler: Any = None,
        speculative: Any = None,
        **sampling_kwargs: Any,
    ) -> str:
        """Queue a prompt (string, token ids or chat messages); returns its request id.

        `prompt_cache`: run this request on the caller's per-layer caches (mlx-lm's `prompt_cache=`, e.g. to
        continue a conversation) instead of arena blocks; `kv_policy` then attaches to that cache and travels
        with it. `sampler`: a callable logprobs -> token used instead of the sampling parameters' own.
        `speculative`: "ngram:k=4,n=3" (prompt lookup), "off", or None for the engine's default."""
        seq = make_sequence(self, prompt, resolve_sampling(sampling, sampling_kwargs), kv_policy=kv_policy,
                            tenant=tenant, request_id=request_id, prompt_cache=prompt_cache, sampler=sampler,
                            speculative=speculative, in_use=self._outputs.in_use)
        self._outputs.track(seq)
        self.scheduler.add(seq)
        return seq.request_id

    @single_threaded
    def abort(self, request_id: str) -> bool:
        self._outputs.forget_in_flight(request_id)
        return self.scheduler.abort(request_id) is not None

    @single_threaded
    def abort_all(self) -> list[str]:
        """Abort every waiting and running request (e.g. after a failed step); returns their ids. Their final
        outputs come with the next `step()`."""
        ids = [seq.request_id for seq in self.scheduler.live_sequences()]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def lookup(self, request_id: str) -> Sequence | None:
        """The live sequence of a waiting or running request (None once it finished or if unknown). Callers read
        it; only the scheduler writes it."""
        return self.scheduler.lookup(request_id)

    def _live(self, request_id: str) -> Sequence:
        seq = self.scheduler.lookup(request_id)
        if seq is None:
            raise InvalidArgumentError(f"request_id: '{request_id}' is not waiting or running")
        return seq

    @single_threaded
    def set_sampler(self, request_id: str, sampler: Any) -> None:
        """Give a request that has not started its first step its own sampler, a callable logprobs `[1, V]` ->
        token `[1]` (e.g. a seeded one, `engine.seeded.seeded_sampler`)."""
        if not callable(sampler):
            raise InvalidArgumentError(f"sampler: expected a callable logprobs -> token, got {type(sampler).__name__}")
        self.scheduler.set_sampler(self._live(request_id), sampler)

    @single_threaded
    def attach_hook(self, request_id: str, hook: SequenceHook) -> None:
        """Run `hook` between two steps when the request's KV holds exactly its first `hook.at_token` tokens
        (see `SequenceHook`)."""
        self.scheduler.attach_hook(self._live(request_id), hook)

    @single_threaded
    def fork(self, prompt_tokens: list[int], sampling: SamplingParams, request_ids: "list[str] | tuple[str, ...]",
             **options: Any) -> Sequence | None:
        """Queue `len(request_ids)` completions of one prompt computed by one prefill (n > 1): the first id is
        the parent, the others are forked from its KV before its last prompt token. Options: `kv_policy`,
        `tenant`, `skip_child(id) -> bool`, `on_child(id, sequence)`. See engine/fork.py."""
        from cortexstream.engine.fork import add_forking_request
        return add_forking_request(self, prompt_tokens, sampling, request_ids, **options)

    def spawn_child(self, parent: Sequence, child_id: str, sampling: SamplingParams) -> Sequence:
        """A running copy of `parent` sharing its computed blocks (for a fork hook, between steps)."""
        if self._outputs.in_use(child_id):
            raise InvalidArgumentError(f"request_id: '{child_id}' is already in use")
        child = Sequence(list(parent.prompt_ids), sampling, request_id=child_id, tenant=parent.tenant,
                         kv_policy=parent.kv_policy, arrival_time=parent.arrival_time)
        child.speculation = None if parent.speculation is None else parent.speculation.fresh()
        self._outputs.track(child)
        self.scheduler.fork(parent, child)
        return child

    def read_kv(self, request_id: str, num_tokens: int | None = None) -> list[tuple[mx.array, mx.array]]:
        """Per layer `(K, V)` `[1, H, N, D]` of a running request's first `num_tokens` (default all) KV slots, as
        evaluated copies. Between steps only (for a `ThreadedEngine`, inside `call`). See engine/kv_edits.py."""
        return kv_edits.read_kv(self.runner, self._live(request_id), num_tokens)

    def write_kv(self, request_id: str, layers: list[tuple[mx.array, mx.array] | None], start: int = 0) -> int:
        """Overwrite KV slots [start, start + N) of a running request with `(K, V)` `[1, H, N, D]` per layer
        (None leaves a layer alone). Shared blocks are copied first, and the request is never recomputed from its
        tokens afterwards (nor prefix-cached). Between steps only. Returns the number of layers written."""
        return kv_edits.write_kv(self.scheduler, self.runner, self._live(request_id), layers, start)

    @single_threaded
    def drop_cached(self, owners: Iterable[int]) -> int:
        """Forget the prefix-cache blocks allocated by these sequences (`SequenceView.owner` ids), e.g. a UI's
        "clear conversation"; returns how many blocks became free (blocks a live sequence holds stay its own)."""
        return self.block_manager.drop_cached(set(owners))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._outputs.has_in_flight

    @property
    def has_in_flight(self) -> bool:
        return self._outputs.has_in_flight

    @property
    def num_generated_tokens(self) -> int:
        return self._outputs.num_generated_tokens

    @property
    def num_prompt_tokens_computed(self) -> int:
        return self._outputs.num_prompt_tokens_computed

    # --- the step ---------------------------------------------------------------------------------------------
    @single_threaded
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> apply. Returns the outputs of every request that produced a token or ended."""
        self.backend.begin_step()
        try:
            return self._step()
        finally:
            self.backend.end_step(self.has_in_flight)  # a launched pass still computes with the step's settings

    def close(self) -> None:
        """Release what the backend holds now (idempotent; a later step takes what it needs again), and write what
        the disk tier has queued and release its directory (for good: later steps run without it)."""
        self.backend.close()
        if self.disk is not None:
            self.disk.close()
            self.disk = self.block_manager.disk = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step(self) -> list[RequestOutput]:
        if self.split_ranks > 1 and self.plan_listener is None:  # checked before the scheduler changes anything
            raise GenerationError(f"the model is split over {self.split_ranks} ranks and this engine is not attached "
                                  "to them: its forward would wait for the other ranks forever. Attach it on rank 0 "
                                  "(ranks.attach(engine)) or pass ranks= to batch_generate (docs/distributed.md)")
        outputs: list[RequestOutput] = []
        if self._outputs.has_in_flight and not (self.pipeline and self.scheduler.may_pipeline()):
            outputs.extend(self._outputs.drain())
        plan, ended = self.scheduler.schedule()
        outputs.extend(self._outputs.final_output(seq) for seq in ended)
        self._outputs.check_dropped(plan.dropped)
        if self.plan_listener is not None:
            self.plan_listener(plan)
        had_in_flight, tic = self._outputs.has_in_flight, time.perf_counter()
        result = self.runner.execute(plan)
        outputs.extend(self._outputs.apply(plan, result))
        self.prefill_time += result.prefill_seconds
        decode_seconds = None
        if plan.decode or had_in_flight:
            decode_seconds = max(0.0, time.perf_counter() - tic - result.prefill_seconds)
            self.decode_time += decode_seconds
        self.num_decode_tokens += len(plan.decode)
        self._adapt(plan, result, decode_seconds, had_in_flight)
        if not self.pipeline:
            outputs.extend(self._outputs.drain())
        if self.disk is not None:
            self.disk.after_step()
        outputs.extend(self._outputs.take_failures())
        return outputs

    def _adapt(self, plan: StepPlan, result: StepResult, decode_seconds: float | None, had_in_flight: bool) -> None:
        """Feed this step's timings to the verify-cost estimate and the adaptive prefill budget (its new budget too);
        `had_in_flight`: the step started with a pass in flight (pipelined)."""
        self.scheduler.observe_step(plan, result, decode_seconds, had_in_flight)
        if self._adaptive is not None:
            budget = self._adaptive.after_step(result.prefill_tokens, result.prefill_seconds, result.mixed_tokens,
                                               decode_seconds, bool(plan.decode), self.runner.mixed_prefill)
            if budget != self.scheduler.config.prefill_tokens_while_decoding:
                self.scheduler.config = replace(self.scheduler.config, prefill_tokens_while_decoding=budget)

    # --- views ------------------------------------------------------------------------------------------------
    @single_threaded
    def snapshot(self, blocks: bool = True) -> EngineView:
        """A read-only `EngineView` of this engine now (live sequences, block counts, counters; with `blocks`,
        the per-block reference counts and owners and the prefix cache's blocks). See engine/snapshot.py."""
        return take_snapshot(self, blocks)

    def stats(self) -> dict[str, Any]:
        """Arena, scheduler, prefix-cache and disk-tier counters (engine/snapshot.py, `engine_stats`)."""
        return engine_stats(self)
