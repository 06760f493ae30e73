"""The speculative verify pass of a step (speculative decoding), run by the runner (engine/runner.py).

A step whose decode items carry drafts (prompt-lookup tokens, `WorkItem.draft`, or a draft model's, `model_draft`)
verifies them all in one packed forward (engine/mixed_batch.py): the plain decode items as decode rows, each drafted
item's token and drafts as a chunk with logits at every row, and the prompt chunks riding in the step. The draft
model proposes first (engine/draft_runner.py), synchronously and timed for the verify-cost estimate
(engine/verify_cost.py). Every drafted item then keeps the drafts its logits agree with plus one token
(engine/draft_verify.py); plain items and finished prompts are sampled through the runner's own `draw`.

It is a module of its own because it is the runner's only pass that works with drafts: it asks the draft model for
proposals, takes logits at every drafted row and keeps what agrees. Everything it needs from the runner comes in as
arguments: the model, arena, backend and draft model, the runner's per-request records (engine/runner_request.py),
the step's `StepOutcome` (engine/step_outcome.py) and the runner's `draw`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.backend import ComputeBackend
from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.engine.draft_runner import DraftRunner
from cortexstream.engine.draft_verify import verify_draft
from cortexstream.engine.forward import head_of
from cortexstream.engine.mixed_batch import MixedBatch
from cortexstream.engine.request_sampler import SamplingFailed
from cortexstream.engine.runner_request import RunnerRequest, decode_tokens
from cortexstream.engine.step_outcome import StepOutcome
from cortexstream.engine.step_plan import SampledToken, WorkItem
from cortexstream.kv.arena import KVArena

# The runner's draw of one row: (request id, lazy token, log-probabilities), or None when its sampler failed (the
# failure is recorded in the outcome).
Draw = Callable[[WorkItem, mx.array, StepOutcome], tuple[str, mx.array, mx.array] | None]


def verify_pass(items: list[WorkItem], chunks: list[WorkItem], out: StepOutcome, *, model: nn.Module,
                arena: KVArena, backend: ComputeBackend, drafter: DraftRunner | None,
                requests: Mapping[str, RunnerRequest], draw: Draw) -> None:
    """Speculative decoding: one packed forward (engine/mixed_batch.py) for the plain decode items, each drafted
    item's token and drafts as a chunk with logits at every row, and `chunks` of prompts; every drafted item
    keeps the drafts its logits agree with plus one token (engine/speculative_sampling.py). Read now: the next
    step drafts from these tokens."""
    plain = [i for i in items if not (i.draft or i.model_draft)]
    drafted = [i for i in items if i.draft or i.model_draft]
    by_model = [i for i in drafted if i.model_draft]
    proposals = {}
    if by_model:  # synchronous (each pass is read to feed the next): timed for the verify-cost estimate
        tic = time.perf_counter()
        proposals = drafter.propose(by_model, {i.request_id: requests[i.request_id].spec.sampling
                                               for i in by_model})
        out.draft_seconds = time.perf_counter() - tic
        out.draft_passes, out.draft_sequences = max(i.model_draft.k for i in by_model), len(by_model)
    drafted = [replace(i, draft=proposals[i.request_id].tokens) if i.model_draft else i for i in drafted]
    arena.grow_ahead()
    backend.before_forward(sum(item.num_tokens for item in items + chunks))
    decode = None
    if plain:
        decode = DecodeBatch(arena, [requests[i.request_id].step_kv(i, arena, model) for i in plain],
                             backend=backend)
    packed = [(item, list(item.token_ids) + list(item.draft)) for item in drafted]
    packed += [(item, list(item.token_ids)) for item in chunks]
    batch = MixedBatch(decode, [(requests[item.request_id].step_kv(item, arena, model), ids) for item, ids in packed],
                       arena=arena)
    hidden = model.model(batch.tokens(decode_tokens(plain, requests) if plain else None), cache=batch.caches())
    batch.commit()
    rows = batch.logit_rows([True] * len(drafted) + [item.sample for item in chunks],
                            every=[True] * len(drafted) + [False] * len(chunks))
    logits = head_of(model)(hidden[mx.array(np.asarray(rows, dtype=np.int32))])[:, 0, :]
    mx.eval(logits)
    drawn = [draw(item, logits[i : i + 1], out) for i, item in enumerate(plain)]
    row = len(plain)
    for item in drafted:
        request, n = requests[item.request_id], len(item.draft) + 1
        try:
            proposal = proposals.get(item.request_id)
            tokens, logprobs = verify_draft(request.sampler, logits[row : row + n], item.draft,
                                            None if proposal is None else proposal.logprobs)
        except SamplingFailed as exc:
            out.errors[item.request_id] = str(exc)
        else:
            request.last = tokens[-1:]
            out.accepted[item.request_id] = tokens.size - 1
            out.sampled.append(SampledToken(item.request_id, tokens, logprobs, ready=True))
        row += n
    for item in chunks:
        if item.sample:
            drawn.append(draw(item, logits[row : row + 1], out))
            row += 1
    drawn = [d for d in drawn if d is not None]
    mx.eval([token for _, token, _ in drawn])
    out.sampled += [SampledToken(rid, token, logprobs, ready=True) for rid, token, logprobs in drawn]


__all__ = ["Draw", "verify_pass"]
