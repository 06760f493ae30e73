"""Executes a `StepPlan` on the model and returns a `StepResult` (engine/step_plan.py).

The runner holds, per request it was told about (`NewRequest`), its view of the KV (a managed `SequenceKV` whose
table and counters come from each `WorkItem`), its policy runtime and its sampler (engine/runner_request.py); it
never sees a `Sequence`. A step copies the planned copy-on-write blocks, then runs the prefill chunks that need passes
of their own (batched by length, engine/prefill_batch.py), then one decode forward for every decode item, with the
remaining prefill chunks packed into it (engine/mixed_batch.py). The decode forward's tokens are sampled lazily and
launched with `mx.async_eval`, so the engine reads them one step later while the next step's graph is being built.
Drafted decode items are verified in the speculative verify pass instead (engine/verify_pass.py). Every pass records
what it produced in the step's `StepOutcome` (engine/step_outcome.py).

KV policies: a request whose policy evicts gets a `PolicyState`. After each of its forward passes (a whole prefill
chunk or the decode step, never inside one, so a chunk's causal mask is never broken) the runner evaluates the
logits first (no lazy graph may still read the slots the eviction rewrites in place), lets the policy evict, and
reports the request's new physical length in the result; the block manager frees the blocks past it.
A reconstruction chunk (`WorkKind.SCORE`, KVzip) runs in a pass of its own like a prefill chunk: its attention is
recorded, its KV rolled back, and the physical length reported (engine/reconstruction_pass.py).

Each forward pass over the arena first lets it grow one layer ahead (`KVArena.grow_ahead`), so a growing arena's
copies and page faults are spread over steps instead of stalling one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.backend import ComputeBackend
from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.engine.forward import body_of, head_of, last_token_logits
from cortexstream.engine.mixed_batch import MixedBatch
from cortexstream.engine.policy_batch_hook import batch_attention_hook, needs_batch_hook
from cortexstream.engine.policy_kv_cache import policy_caches
from cortexstream.engine.policy_runtime import PolicyState
from cortexstream.engine.prefill_batch import PrefillBatch, group_chunks
from cortexstream.engine.request_sampler import ConstraintFactory, RequestSampler, SamplingFailed
from cortexstream.engine.reconstruction_pass import score_item
from cortexstream.engine.runner_request import RunnerRequest, decode_tokens
from cortexstream.engine.step_outcome import StepOutcome
from cortexstream.engine.step_plan import NewRequest, SampledToken, StepPlan, StepResult, WorkItem, WorkKind
from cortexstream.engine.verify_pass import verify_pass
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.block_io import import_blocks
from cortexstream.kv.sequence_kv import SequenceKV


class ModelRunner:
    def __init__(self, model: nn.Module, arena: KVArena, backend: ComputeBackend | None = None, *,
                 batch_prefill: bool = True, mixed_prefill: bool = True,
                 constraints: ConstraintFactory | None = None, drafter: Any = None) -> None:
        self.model = model
        self.drafter = drafter  # a DraftRunner (engine/draft_runner.py) for draft-model speculation, or None
        self.constraints = constraints  # grammar -> a fresh TokenConstraint (the engine's GrammarCompiler)
        self.arena = arena
        # The compute backend (attention strategies, per-pass settings); None: the one for this device.
        self.backend = backend if backend is not None else ComputeBackend.for_engine(0, model=model)
        # Several requests' prefill chunks in one forward pass (False: one per pass).
        self.batch_prefill = batch_prefill
        # Prefill chunks packed into the decode forward of a step that decodes (see engine/mixed_batch.py).
        self.mixed_prefill = mixed_prefill
        self._requests: dict[str, RunnerRequest] = {}

    # --- per-request state ------------------------------------------------------------------------------------
    def knows(self, request_id: str) -> bool:
        return request_id in self._requests

    def kv_view(self, request_id: str) -> SequenceKV | None:
        """The request's KV view as of its last step (tests and diagnostics read it)."""
        request = self._requests.get(request_id)
        return None if request is None else request.kv

    def policy_view(self, request_id: str) -> PolicyState | None:
        """The request's policy state (scores, positions, statistics), None without an evicting policy."""
        request = self._requests.get(request_id)
        return None if request is None else request.policy

    def _open(self, spec: NewRequest) -> None:
        sampler = RequestSampler(spec.sampling, spec.token_ids, spec.sampler, self.constraints, spec.num_prompt_tokens)
        self._requests[spec.request_id] = RunnerRequest(spec, sampler)

    def _kv(self, request: RunnerRequest, item: WorkItem) -> SequenceKV:
        return request.step_kv(item, self.arena, self.model)

    def _caches(self, request: RunnerRequest, kv: SequenceKV) -> list[Any]:
        if request.policy is not None:
            return policy_caches(kv, request.policy)
        return [ArenaKVCache(kv, layer) for layer in range(self.arena.config.num_layers)]

    # --- between steps: KV read and written from outside the model (C2C fusion) -------------------------------
    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: each (source, destination) block, in order, before anything writes."""
        if pairs:
            with self.arena.lock:
                for src, dst in pairs:
                    self.arena.copy_block(src, dst)

    def read_kv(self, block_table: tuple[int, ...], num_tokens: int) -> list[tuple[mx.array, mx.array]]:
        """Per layer `(K, V)` `[1, H, N, D]` of the first `num_tokens` slots: evaluated copies, never views."""
        layers = []
        for layer in range(self.arena.config.num_layers):
            k, v = self.arena.read(layer, list(block_table), num_tokens)
            layers.append((mx.multiply(k, 1)[None], mx.multiply(v, 1)[None]))  # x*1 copies bit-exactly (keeps -0.0)
        mx.eval(layers)
        return layers

    def write_kv(self, block_table: tuple[int, ...], start: int,
                 layers: list[tuple[int, tuple[mx.array, mx.array]]]) -> None:
        """Write `(layer, (K, V) [1, H, N, D])` at slots [start, start + N) of a (private) block table."""
        with self.arena.lock:
            for layer, (k, v) in layers:
                self.arena.write(layer, list(block_table), start, k[0], v[0])
            mx.eval(self.arena.arrays())

    # --- the step ---------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.dropped:
            self._requests.pop(request_id, None)
        for spec in plan.new_requests:
            self._open(spec)
        self.arena.ensure_blocks(plan.num_blocks_used)
        if self.drafter is not None:
            self.drafter.mirror(plan.num_blocks_used, plan.copies)
        if plan.restores:
            import_blocks(self.arena, [block for block, _ in plan.restores], [data for _, data in plan.restores])
        self.copy_blocks(plan.copies)
        if self.drafter is not None:  # prompt chunks the draft model computes too (engine/draft_decode.py)
            self.drafter.feed([item for item in plan.prefill if item.model_draft is not None])
        out = StepOutcome()
        decode = list(plan.decode)
        mixed = self._mixable(decode, plan.prefill) if self.mixed_prefill and decode else []
        riding = {id(item) for item in mixed}
        separate = [item for item in plan.prefill if id(item) not in riding] + list(plan.score)
        tic = time.perf_counter()
        self._prefill(separate, out)
        out.prefill_seconds = time.perf_counter() - tic
        drafting = [item for item in decode if item.draft or item.model_draft]
        if drafting and head_of(self.model) is not None:
            self._verify(decode, mixed, out)
        elif decode:  # no draft verified: none kept (draft models are refused for such models at load)
            self._decode([replace(item, draft=(), model_draft=None) for item in decode], mixed, out)
            out.accepted.update({item.request_id: 0 for item in drafting})
        return out.result(sum(i.num_tokens for i in separate), sum(i.num_tokens for i in mixed))

    def _mixable(self, decode: list[WorkItem], items: tuple[WorkItem, ...]) -> list[WorkItem]:
        """The prefill items that may ride in the decode forward: none unless every decode row can (on the arena,
        no evicting policy, a known model layout), then those marked mixable."""
        if head_of(self.model) is None or any(
                item.alone or self._requests[item.request_id].spec.kv_policy.evicts for item in decode):
            return []
        return [item for item in items if item.mixable]

    def _prefill(self, items: list[WorkItem], out: StepOutcome) -> None:
        """Prefill chunks in passes of their own; the first tokens of finished prompts are sampled and read."""
        drawn = []
        for group in group_chunks(items, self.batch_prefill):
            self.backend.before_forward(sum(item.num_tokens for item in group))
            logits = self._prefill_group(group) if len(group) > 1 else [self._prefill_one(group[0], out)]
            drawn += [self._draw(item, row, out) for item, row in zip(group, logits) if row is not None]
        drawn = [d for d in drawn if d is not None]
        if drawn:
            mx.eval([token for _, token, _ in drawn])
            out.sampled += [SampledToken(rid, token, logprobs, ready=True) for rid, token, logprobs in drawn]

    def _prefill_one(self, item: WorkItem, out: StepOutcome) -> mx.array | None:
        """One chunk in its own pass; the logits `[1, V]` of its last token when the item samples."""
        request = self._requests[item.request_id]
        tokens = mx.array(item.token_ids, dtype=mx.uint32)[None]
        if request.spec.bound_cache is not None:
            return self._bound_forward(request, tokens, item.sample)
        self.arena.grow_ahead()
        kv = self._kv(request, item)
        if item.kind is WorkKind.SCORE:  # a reconstruction chunk: scores recorded, KV rolled back, nothing sampled
            out.physical[item.request_id] = score_item(self.model, kv, request.policy, item.token_ids, item.compress,
                                                       request.spec.max_total_tokens)
            return None
        caches = self._caches(request, kv)
        if item.sample:
            logits = last_token_logits(self.model, tokens, caches)[0]
        else:
            logits = None
            body_of(self.model)(tokens, cache=caches)
        # Evaluate now, not with the step's other logits: a later pass in the same step writing the arena while
        # this graph (holding views of the layer buffers) is pending would make MLX copy every layer buffer.
        policy = request.policy
        mx.eval([a for a in (logits,) if a is not None], self.arena.arrays(),
                policy.pending_arrays() if policy is not None else [])
        self._after_forward(request, kv, item, out)
        return logits

    def _prefill_group(self, items: list[WorkItem]) -> list[mx.array | None]:
        """One forward over several requests' chunks (none with an evicting policy or a caller's cache)."""
        self.arena.grow_ahead()
        requests = [self._requests[item.request_id] for item in items]
        kvs = [self._kv(request, item) for request, item in zip(requests, items)]
        batch = PrefillBatch(self.arena, kvs, [list(item.token_ids) for item in items])
        logits = last_token_logits(self.model, batch.tokens, batch.caches())[:, 0, :]
        batch.commit()
        done = [item.sample for item in items]
        mx.eval(logits if any(done) else [], self.arena.arrays())  # as in `_prefill_one`
        return [logits[i : i + 1] if finished else None for i, finished in enumerate(done)]

    def _decode(self, items: list[WorkItem], chunks: list[WorkItem], out: StepOutcome) -> None:
        """One forward for every decode item (with `chunks` of prompts packed in), sampled and launched."""
        requests = [self._requests[item.request_id] for item in items]
        tokens = decode_tokens(items, self._requests)
        self.backend.before_forward(len(items) + sum(item.num_tokens for item in chunks))
        firsts: list[tuple[WorkItem, mx.array]] = []
        if chunks:
            logits, chunk_logits = self._mixed(items, tokens, chunks)
            firsts = [(item, row) for item, row in zip(chunks, chunk_logits) if row is not None]
        elif all(request.spec.bound_cache is None for request in requests):
            logits = self._decode_arena(items, tokens, out)
        else:
            logits = self._decode_with_bound(items, tokens, out)
        drawn = [self._draw(item, logits[i : i + 1], out) for i, item in enumerate(items)]
        # A prompt finished in the mixed pass: its first token is in flight like the decode tokens.
        drawn += [self._draw(item, row, out) for item, row in firsts]
        drawn = [d for d in drawn if d is not None]
        # Log-probabilities: only what sampling needed. A mixed pass is computed now, not overlapped with the next
        # step: the next step reads its tokens first anyway (a prompt was prefilling), and the adaptive budget
        # needs the pass's real time.
        (mx.eval if chunks else mx.async_eval)([token for _, token, _ in drawn])
        out.sampled += [SampledToken(rid, token, logprobs, ready=False) for rid, token, logprobs in drawn]

    def _verify(self, items: list[WorkItem], chunks: list[WorkItem], out: StepOutcome) -> None:
        """Speculative decoding: the drafted items verified in one packed forward with the plain decode items and
        `chunks` of prompts (engine/verify_pass.py), sampled through `_draw`."""
        verify_pass(items, chunks, out, model=self.model, arena=self.arena, backend=self.backend,
                    drafter=self.drafter, requests=self._requests, draw=self._draw)

    def _decode_arena(self, items: list[WorkItem], tokens: mx.array, out: StepOutcome) -> mx.array:
        """One batched decode forward over arena requests; logits `[B, V]`."""
        self.arena.grow_ahead()
        requests = [self._requests[item.request_id] for item in items]
        kvs = [self._kv(request, item) for request, item in zip(requests, items)]
        states = [request.policy for request in requests]
        if len(items) == 1:  # contiguous tables get zero-copy views through the single-sequence cache
            logits = self.model(tokens, cache=self._caches(requests[0], kvs[0]))
        else:
            batch = DecodeBatch(self.arena, kvs, backend=self.backend)
            caches = batch.caches()
            if needs_batch_hook(states):  # attention scores (H2O) or logit biases of merged slots
                for cache in caches:
                    cache.attention_hook = batch_attention_hook(cache.layer, batch.lengths_after, states,
                                                              attend=getattr(cache, "attend", None))
            logits = self.model(tokens, cache=caches)
            batch.commit()
        logits = logits[:, -1, :]
        if any(s is not None for s in states):
            mx.eval(logits, [s.pending_arrays() for s in states if s is not None])
        for request, kv, item in zip(requests, kvs, items):
            self._after_forward(request, kv, item, out)
        return logits

    def _mixed(self, items: list[WorkItem], tokens: mx.array,
               chunks: list[WorkItem]) -> tuple[mx.array, list[mx.array | None]]:
        """One forward that decodes `items` and computes each chunk; the decode logits `[B, V]` and, per chunk,
        the logits `[1, V]` of its last token when it samples."""
        self.arena.grow_ahead()
        kvs = [self._kv(self._requests[item.request_id], item) for item in items]
        chunk_kvs = [self._kv(self._requests[item.request_id], item) for item in chunks]
        batch = MixedBatch(DecodeBatch(self.arena, kvs, backend=self.backend),
                           [(kv, list(item.token_ids)) for kv, item in zip(chunk_kvs, chunks)])
        hidden = self.model.model(batch.tokens(tokens), cache=batch.caches())  # [T, 1, hidden]
        batch.commit()
        done = [item.sample for item in chunks]
        rows = batch.logit_rows(done)
        logits = head_of(self.model)(hidden[mx.array(np.asarray(rows, dtype=np.int32))])[:, 0, :]
        chunk_logits: list[mx.array | None] = []
        row = len(items)
        for finished in done:
            chunk_logits.append(logits[row : row + 1] if finished else None)
            row += int(finished)
        return logits[: len(items)], chunk_logits

    def _after_forward(self, request: RunnerRequest, kv: SequenceKV, item: WorkItem, out: StepOutcome) -> None:
        """Let an evicting policy act on the request's KV; report its physical length when it changed."""
        if request.policy is None:
            return
        request.policy.after_forward(kv, request.spec.max_total_tokens)
        if kv.num_tokens != item.physical_start + item.num_tokens:
            out.physical[item.request_id] = kv.num_tokens

    # --- requests on a caller's prompt cache ------------------------------------------------------------------
    def _bound_forward(self, request: RunnerRequest, tokens: mx.array, want_logits: bool) -> mx.array | None:
        return request.spec.bound_cache.forward(self.model, head_of(self.model), tokens, want_logits=want_logits)

    def _decode_with_bound(self, items: list[WorkItem], tokens: mx.array, out: StepOutcome) -> mx.array:
        """Arena requests in one batched forward, each bound one in its own; logits `[B, V]` in `items` order."""
        rows = [i for i, item in enumerate(items) if self._requests[item.request_id].spec.bound_cache is None]
        logits: list[mx.array | None] = [None] * len(items)
        if rows:
            batch = self._decode_arena([items[i] for i in rows], tokens[mx.array(rows)], out)
            for j, i in enumerate(rows):
                logits[i] = batch[j : j + 1]
        for i, item in enumerate(items):
            if logits[i] is None:
                logits[i] = self._bound_forward(self._requests[item.request_id], tokens[i : i + 1], True)
        return mx.concatenate(logits, axis=0)

    # --- sampling ---------------------------------------------------------------------------------------------
    def _draw(self, item: WorkItem, logits: mx.array, out: StepOutcome) -> tuple[str, mx.array, mx.array] | None:
        """The lazy token and log-probabilities of one request, or None when its sampler failed (reported)."""
        request = self._requests[item.request_id]
        try:
            token, logprobs = request.sampler.draw(logits)
        except SamplingFailed as exc:
            out.errors[item.request_id] = str(exc)
            return None
        request.last = token
        return item.request_id, token, logprobs
