"""A model's head profile by KVzip's criterion: each key's most attention from a repetition of its context,
averaged per (layer, KV head) over calibration texts.

Each calibration sequence is prefilled into a cache that carries a KVzip policy with no effective budget (nothing
is evicted), then repeated in chunks (`engine.reconstruction_pass.reconstruct`), which leaves every key's
maximum in the policy state. A head's score for one text is the mean over its keys, leaving out the first
`sinks` (every head attends its sinks) and the last `window` (the reconstruction's own neighbourhood); the profile
is the mean over the texts. Texts come from `training.text` (held out from every benchmark).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from cortexstream.engine.policy_prompt_cache import make_policy_cache, policy_state_of
from cortexstream.engine.reconstruction_pass import reconstruct
from cortexstream.engine.reconstruction_prompt import reconstruction_prompt
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.answering import feed_chunks


def text_scores(model: Any, tokenizer: Any, ids: Sequence[int], chunk: int, sinks: int, window: int) -> np.ndarray:
    """`[layers, kv_heads]`: the mean KVzip score of each head's keys over one text."""
    if len(ids) <= sinks + window:
        raise InvalidArgumentError(f"head profile: a text of {len(ids)} tokens leaves no keys after {sinks} sinks "
                                   f"and a window of {window}")
    unbounded = len(ids) * 4  # a budget the text never reaches: the policy only scores
    cache = make_policy_cache(model, f"kvzip:budget={unbounded},chunk={chunk}", max_tokens=len(ids) + 2 * chunk)
    state = policy_state_of(cache)
    state.expect_prompt_end(len(ids))
    feed_chunks(model, cache, list(ids), chunk, unbounded)
    reconstruct(model, cache, list(ids), reconstruction_prompt(tokenizer), unbounded, chunk=chunk)
    scores = np.stack(state.scores)  # [L, H, n]
    return scores[:, :, sinks:len(ids) - window].mean(axis=-1)


def measure_profile(model: Any, tokenizer: Any, texts: Sequence[Sequence[int]], chunk: int = 256, sinks: int = 4,
                    window: int = 64, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """The profile `[layers, kv_heads]`: `text_scores` averaged over `texts`."""
    if not texts:
        raise InvalidArgumentError("head profile: no calibration texts")
    out = []
    for i, ids in enumerate(texts):
        out.append(text_scores(model, tokenizer, ids, chunk, sinks, window))
        if progress is not None:
            progress(i + 1)
    return np.mean(out, axis=0)


__all__ = ["measure_profile", "text_scores"]
