"""One request's drafted tokens checked against the target model's logits: what it keeps and what it samples next.

Greedy requests keep the drafts that equal the argmax at their position and add the argmax after the last kept one,
so the output is token for token what plain greedy decoding gives. Sampled requests use speculative rejection
sampling against the distribution the request's own sampler draws from (temperature, top-p, min-p, top-k, as
mlx-lm's sampler applies them; engine/speculative_sampling.py), so the output follows that distribution. Requests
whose next-token distribution depends on the drafted tokens themselves (a repetition penalty, a grammar) or that
bring their own sampler are never given drafts (the scheduler's `_draft`), so neither is handled here.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from cortexstream.engine.request_sampler import RequestSampler, SamplingFailed
from cortexstream.engine.speculative_sampling import target_logprobs, verify_greedy, verify_sampled


def verify_draft(sampler: RequestSampler, logits: mx.array, draft: Sequence[int],
                 draft_logprobs: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """`logits` `[k+1, V]`: the target's logits after the request's last token and after each of the k drafted
    tokens; `draft_logprobs` `[k, V]`: the draft model's distributions the drafts were drawn from (None: a
    deterministic proposer, prompt lookup). Returns the kept drafts followed by one sampled token (`[m+1]` uint32,
    evaluated) and their log-probabilities `[m+1, V]`. Raises SamplingFailed for a request this cannot verify."""
    if sampler.custom or sampler.processors or sampler.sampling.grammar is not None:
        raise SamplingFailed("sampling failed: drafted tokens reached a request with its own sampler, logits "
                             "processors or a grammar (internal: such requests are never given drafts)")
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if sampler.sampling.greedy:
        tokens = verify_greedy(logits, list(draft))
    else:
        tokens = verify_sampled(target_logprobs(logprobs, sampler.sampling), list(draft), draft_logprobs)
    out = mx.array(tokens, dtype=mx.uint32)
    mx.eval(out)
    return out, logprobs[: len(tokens)]


__all__ = ["verify_draft"]
