"""`Engine`: add_request / step / abort over the scheduler and runner; step() = schedule -> run -> postprocess.

Pipelined decode (`pipeline=True`, the default). Reading a sampled token (`.item()`) waits for the whole forward
pass; building the next step's graph costs milliseconds of Python per step (about 10% of a SmolLM2 decode step on
CPU). So a decode step is launched (`mx.async_eval`) on the previous step's sampled tokens while they are still
lazy, and only then are those tokens read and post-processed: graph building and post-processing overlap the
computation, as in mlx-lm's `generate_step`. A sampled-but-unread token is "in flight" (`Sequence.num_inflight`),
and its output is emitted by the next `step()` call. When the previous token ends a request (eos, a stop string),
the step launched for it is discarded (its request is finished and its blocks freed); a request whose unread token
is its last by `max_tokens` gets no further step. Steps that could admit, prefill or preempt (waiting requests,
a prompt in progress, few free blocks) first read every token in flight, so recompute-preemption never loses one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from cortexstream.backend import ensure_buffer_cache
from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.bound_cache import BoundCache
from cortexstream.engine.chunk_budget import AdaptivePrefillBudget
from cortexstream.engine.runner import ModelRunner
from cortexstream.engine.small_batch_kernel import (
    KernelHold, blas_threads_for_pass, resolve_small_batch_rows, with_row_limit,
)
from cortexstream.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.snapshot import EngineView, take_snapshot
from cortexstream.errors import InvalidArgumentError
from cortexstream.engine.single_thread import single_threaded
from cortexstream.engine.prompt import prompt_to_tokens
from cortexstream.engine.request_state import RequestOutput, _RequestState
from cortexstream.engine.sampling import SamplingParams, keep_random_state, sampling_from_kwargs
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.policies.parsing import parse_policy


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
    ) -> None:
        if arena is None:
            if kv_tokens is None and kv_bytes is None:
                kv_tokens = 16384
            arena = KVArena(ArenaConfig.for_model(model, num_tokens=kv_tokens, num_bytes=kv_bytes,
                                                  block_size=block_size))
        ensure_buffer_cache()
        self.model = model
        # Policy for requests that name none (a KVPolicy or a string such as 'h2o:budget=0.2').
        self.kv_policy = parse_policy(kv_policy)
        self.tokenizer = tokenizer
        self.arena = arena
        self.block_manager = BlockManager(arena.allocator, arena.config.block_size, prefix_caching)
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
        self.runner = ModelRunner(model, arena)
        self.kernel_hold = KernelHold(resolve_small_batch_rows(small_batch_matmul))  # engine/small_batch_kernel.py
        self._states: dict[str, _RequestState] = {}
        self._eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        # Wall time spent in prefill chunks vs decode batches (each evaluated before the clock is read).
        self.prefill_time = 0.0
        self.decode_time = 0.0
        self.num_decode_tokens = 0
        self.pipeline = pipeline
        # Several sequences' prefill chunks in one forward pass (False: one per pass, bit-for-bit as before).
        self.batch_prefill = batch_prefill
        # Prefill chunks packed into the decode forward of a step that decodes (see engine/mixed_batch.py).
        self.mixed_prefill = mixed_prefill
        # request id -> (sequence, lazy sampled token [1], lazy logprobs [V]) of the decode step in flight
        self._inflight: dict[str, tuple[Sequence, mx.array, mx.array]] = {}
        self._failures: list[RequestOutput] = []  # requests ended by a failed sampler during this step

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
        **sampling_kwargs: Any,
    ) -> str:
        """Queue a prompt (string, token ids or chat messages); returns its request id.

        `prompt_cache`: run this request on the caller's per-layer caches (mlx-lm's `prompt_cache=`, e.g. to
        continue a conversation) instead of arena blocks; `kv_policy` then attaches to that cache and travels
        with it. `sampler`: a callable logprobs -> token used instead of the sampling parameters' own."""
        if sampling is None:
            sampling = sampling_from_kwargs(**sampling_kwargs)
        elif sampling_kwargs:
            raise InvalidArgumentError(f"add_request: pass either sampling= or {sorted(sampling_kwargs)}, not both")
        elif not isinstance(sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        tokens = prompt_to_tokens(self.tokenizer, prompt)
        policy = self.kv_policy if kv_policy is None else parse_policy(kv_policy)
        if sampler is not None and not callable(sampler):
            raise InvalidArgumentError(f"sampler: expected a callable logprobs -> token, got {type(sampler).__name__}")
        if prompt_cache is not None:
            bound = BoundCache.bind(prompt_cache, self.model, None if kv_policy is None else policy,
                                    len(tokens) + sampling.max_tokens)
            seq = Sequence(tokens, sampling, tenant=tenant, bound_cache=bound, kv_from_tokens=False)
        else:
            seq = Sequence(tokens, sampling, tenant=tenant, kv_policy=policy)
        if request_id is not None:
            if request_id in self._states:
                raise InvalidArgumentError(f"request_id: '{request_id}' is already in use")
            seq.request_id = request_id
        self._states[seq.request_id] = _RequestState(seq, self.tokenizer, self._eos_ids, sampler)
        self.scheduler.add(seq)
        return seq.request_id

    @single_threaded
    def abort(self, request_id: str) -> bool:
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            entry[0].num_inflight = 0
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.runner.drop(seq)
        return seq is not None

    @single_threaded
    def drop_cached(self, owners: Iterable[int]) -> int:
        """Forget the prefix-cache blocks allocated by these sequences (`SequenceView.owner` ids), e.g. a UI's
        "clear conversation"; returns how many blocks became free (blocks a live sequence holds stay its own)."""
        return self.block_manager.drop_cached(set(owners))

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

    @single_threaded
    def set_sampler(self, request_id: str, sampler: Any) -> None:
        """Give a queued or running request its own sampler, a callable logprobs `[1, V]` -> token `[1]` (e.g. a
        seeded one, `engine.seeded.seeded_sampler`)."""
        if not callable(sampler):
            raise InvalidArgumentError(f"sampler: expected a callable logprobs -> token, got {type(sampler).__name__}")
        state = self._states.get(request_id)
        if state is None:
            raise InvalidArgumentError(f"request_id: '{request_id}' is not waiting or running")
        state.set_sampler(sampler)

    @single_threaded
    def fork(self, prompt_tokens: list[int], sampling: SamplingParams, request_ids: "list[str] | tuple[str, ...]",
             **options: Any) -> Sequence | None:
        """Queue `len(request_ids)` completions of one prompt computed by one prefill (n > 1): the first id is
        the parent, the others are forked from its KV before its last prompt token. Options: `kv_policy`,
        `tenant`, `skip_child(id) -> bool`, `on_child(id, sequence)`. See engine/fork.py."""
        from cortexstream.engine.fork import add_forking_request
        return add_forking_request(self, prompt_tokens, sampling, request_ids, **options)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._inflight)

    @property
    def has_in_flight(self) -> bool:
        return bool(self._inflight)

    # --- the step ---------------------------------------------------------------------------------------------
    @single_threaded
    @with_row_limit
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self._inflight and not self._may_pipeline():
            outputs.extend(self._drain())
        step = self.scheduler.schedule()
        outputs.extend(self._final_output(seq) for seq in step.finished)
        for seq in step.preempted:
            if seq.request_id in self._inflight:
                if not seq.is_finished:  # _may_pipeline rules this out; never lose a token silently
                    raise RuntimeError(f"internal: request '{seq.request_id}' preempted with a token in flight")
                self._inflight.pop(seq.request_id)  # failed by the scheduler: its unread token goes with it
                seq.num_inflight = 0
            self.runner.drop(seq)
        # Chunks that ride in the decode forward (engine/mixed_batch.py); the others get passes of their own.
        mixed = self.runner.mixable(step.decode, step.prefill) if self.mixed_prefill else []
        tic = time.perf_counter()
        outputs.extend(self._prefill([item for item in step.prefill if item not in mixed]))
        toc = time.perf_counter()
        self.prefill_time += toc - tic
        decode_seconds = None
        if step.decode or self._inflight:
            outputs.extend(self._decode(step.decode, mixed))
            decode_seconds = time.perf_counter() - toc
            self.decode_time += decode_seconds
        if self._adaptive is not None:
            separate = sum(n for _, n in step.prefill) - sum(n for _, n in mixed)
            self._adaptive.observe(separate, toc - tic, decode_seconds if step.decode and not mixed else None)
            if mixed and decode_seconds is not None:
                self._adaptive.observe_mixed(sum(n for _, n in mixed), decode_seconds)
            budget = self._adaptive.tokens(mixed=self.mixed_prefill)
            if budget != self.scheduler.config.prefill_tokens_while_decoding:
                self.scheduler.config = replace(self.scheduler.config, prefill_tokens_while_decoding=budget)
        outputs.extend(self._failures)
        self._failures = []
        return outputs

    def _may_pipeline(self) -> bool:
        """True when this step can only decode: nothing to admit or prefill, and blocks enough for every
        running sequence to grow (and copy on write) without preempting anyone."""
        scheduler = self.scheduler
        if not self.pipeline or scheduler.waiting or any(s.num_pending > 1 for s in scheduler.running):
            return False
        # A sequence with room reserved for its next two tokens needs no block, unless it writes a shared one.
        allocator, bs = self.arena.allocator, self.arena.config.block_size
        need = 2
        for seq in scheduler.running:
            table = seq.block_table
            if not seq.uses_arena:
                continue
            if len(table) * bs < seq.num_tokens + 2 or allocator.ref_count(table[seq.num_physical // bs]) > 1:
                need += 2
        return allocator.num_free_blocks >= need

    def _prefill(self, items: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """Prefill chunks in passes of their own (batched by length); first tokens of finished prompts are read."""
        sampled: list[tuple[Sequence, mx.array]] = []
        for group in ScheduledStep(prefill=items).prefill_groups() if self.batch_prefill else [[i] for i in items]:
            blas_threads_for_pass(sum(n for _, n in group))
            logits_per_item = self.runner.prefill_batch(group)
            self._computed(group)
            sampled += [(seq, logits) for (seq, _), logits in zip(group, logits_per_item) if logits is not None]
        if not sampled:
            return []
        drawn = [(seq, self._sample(self._states[seq.request_id], logits)) for seq, logits in sampled]
        drawn = [(seq, draw) for seq, draw in drawn if draw is not None]  # a failed sampler ended its request
        mx.eval([token for _, (token, _) in drawn])
        return [self._emit(seq, int(token.item()), logprobs) for seq, (token, logprobs) in drawn]

    def _computed(self, items: list[tuple[Sequence, int]]) -> None:
        for seq, chunk in items:
            self.num_prompt_tokens_computed += chunk
            if seq.hook is None and not seq.kv_policy.evicts:
                # Full prompt blocks enter the prefix cache as soon as they are computed, so a request
                # waiting on the same prefix starts from them (see BlockManager.waits_for_shared_prefix).
                self.block_manager.register_full_blocks(seq)

    def _decode(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int]] = ()) -> list[RequestOutput]:  # type: ignore[assignment]
        """Launch one decode step on the (possibly still lazy) pending tokens, with `chunks` of prompts packed
        into the same forward (`runner.mixed`), then read the previous step's tokens."""
        previous, self._inflight = self._inflight, {}
        # An unread token that is its request's last by length needs no step after it.
        seqs = [s for s in seqs if not (s.num_inflight and len(s.output_ids) + 1 >= s.sampling.max_tokens)]
        launched = []
        early = self._prefill(list(chunks)) if chunks and not seqs else []  # nothing left to mix with
        chunks = chunks if seqs else []
        if seqs:
            pending = [previous[s.request_id][1] if s.num_inflight else None for s in seqs]
            tokens = None
            if any(p is not None for p in pending):
                tokens = mx.concatenate([
                    p.astype(mx.uint32).reshape(1) if p is not None
                    else mx.array([s.token_at(s.num_computed)], dtype=mx.uint32)
                    for s, p in zip(seqs, pending)
                ]).reshape(-1, 1)
            firsts: list[tuple[Sequence, mx.array]] = []
            blas_threads_for_pass(len(seqs) + sum(n for _, n in chunks))
            if chunks:
                logits, chunk_logits = self.runner.mixed(seqs, tokens, chunks)
                self._computed(chunks)
                firsts = [(seq, out) for (seq, _), out in zip(chunks, chunk_logits) if out is not None]
            else:
                logits = self.runner.decode(seqs, tokens)
            draws = [self._sample(self._states[s.request_id], logits[i : i + 1], p)
                     for i, (s, p) in enumerate(zip(seqs, pending))]
            # A prompt finished in the mixed pass: its first token is in flight like the decode tokens.
            first_draws = [self._sample(self._states[seq.request_id], out) for seq, out in firsts]
            # Log-probabilities: only what sampling needed. A mixed pass is computed now, not overlapped with the next
            # step: the next step reads its tokens first anyway (a prompt was prefilling), and the adaptive budget
            # needs the pass's real time.
            (mx.eval if chunks else mx.async_eval)([d[0] for d in draws + first_draws if d is not None])
            launched = [(seq, draw) for seq, draw in zip(seqs + [seq for seq, _ in firsts], draws + first_draws)
                        if draw is not None]  # a failed sampler ended its request
            self.num_decode_tokens += len(seqs)
        outputs = early + self._resolve(previous)
        for seq, (token, logprobs) in launched:
            if seq.is_finished or seq.request_id not in self._states:
                continue  # the token it was launched on ended the request: discard this one
            seq.num_inflight = 1
            self._inflight[seq.request_id] = (seq, token, logprobs)
        if not self.pipeline:
            outputs.extend(self._drain())
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Read and post-process every token in flight."""
        entries, self._inflight = self._inflight, {}
        return self._resolve(entries)

    def _resolve(self, entries: dict[str, tuple[Sequence, mx.array, mx.array]]) -> list[RequestOutput]:
        if not entries:
            return []
        mx.eval([token for _, token, _ in entries.values()])
        outputs = []
        for seq, token, logprobs in entries.values():
            seq.num_inflight = 0
            if seq.is_finished or seq.request_id not in self._states:
                continue
            outputs.append(self._emit(seq, int(token.item()), logprobs))
        return outputs

    def _sample(self, state: _RequestState, logits: mx.array,
                pending: mx.array | None = None) -> tuple[mx.array, mx.array] | None:
        """The lazy token and log-probabilities for one request, or None when its sampler (or a logits processor)
        failed: that request then ends with finish_reason "error" (reported by this step) and the others go on."""
        try:
            with keep_random_state():  # a sampler that raises must not leave MLX's random state broken for others
                token, logprobs = state.draw(logits, pending)
            if token.size != 1 or not mx.issubdtype(token.dtype, mx.integer):
                raise TypeError(f"the sampler returned a {token.dtype} array of shape {tuple(token.shape)}, "
                                "expected one integer token id")
        except Exception as exc:  # noqa: BLE001 - any failure ends this request only, with its reason
            self._fail(state.seq, f"sampling failed: {type(exc).__name__}: {exc}")
            return None
        return token, logprobs

    def _fail(self, seq: Sequence, reason: str) -> None:
        """End a running request with finish_reason "error"; its output goes out with this step's."""
        self._inflight.pop(seq.request_id, None)
        seq.num_inflight = 0
        self.scheduler.finish(seq, "error", reason)
        self.runner.drop(seq)
        self._failures.append(self._final_output(seq))

    def _emit(self, seq: Sequence, token_id: int, logprobs: mx.array) -> RequestOutput:
        """Append one read token to its request: text, stop conditions, prefix-cache blocks, finishing."""
        state = self._states[seq.request_id]
        now = time.perf_counter()
        seq.output_ids.append(token_id)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if token_id in state.eos_ids:
            text, reason = state.text.finish(), "stop"
        else:
            text = state.text.add_token(token_id)
            reason = "stop" if state.text.stopped else None
            if reason is None and len(seq.output_ids) >= seq.sampling.max_tokens:
                text = text + state.text.finish()
                # The flush can complete a stop string that the held-back text hid until now.
                reason = "stop" if state.text.stopped else "length"
        if not seq.kv_policy.evicts:
            # An evicting sequence's blocks stay private: a shared block would have to be copied on write
            # by the next eviction, which may find no free block.
            self.block_manager.register_full_blocks(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.runner.drop(seq)
            del self._states[seq.request_id]
        return RequestOutput(
            seq.request_id, token_id, text, logprobs, len(seq.prompt_ids), len(seq.output_ids), reason,
            ttft=seq.first_token_time - seq.arrival_time,
        )

    def _final_output(self, seq: Sequence) -> RequestOutput:
        self._states.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, None, "", None, len(seq.prompt_ids), len(seq.output_ids),
                             seq.finish_reason, seq.error)

    # --- views ------------------------------------------------------------------------------------------------
    @single_threaded
    def snapshot(self, blocks: bool = True) -> EngineView:
        """A read-only `EngineView` of this engine now (live sequences, block counts, counters; with `blocks`,
        the per-block reference counts and owners and the prefix cache's blocks). See engine/snapshot.py."""
        return take_snapshot(self, blocks)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self.arena.stats())
        stats.update(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions,
            prefix_cached_blocks=self.block_manager.num_cached_blocks,
            prefix_hit_blocks=self.block_manager.num_prefix_hits,
            generated_tokens=self.num_generated_tokens,
        )
        return stats
