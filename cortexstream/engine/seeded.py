"""Per-request sampling seeds for the batched engine.

mlx-lm's samplers draw from MLX's global random state, which every request in a batch advances, so a request's
`seed` alone cannot make its tokens repeatable. A seeded request gets its own sampler instead: the same filters
as mlx-lm's `make_sampler` (top-p, min-p, top-k, in that order) and a categorical draw with an explicit key that
is split once per sampled token. The same seed, prompt and parameters then give the same tokens whatever else
the engine is running.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from cortexstream.engine.sampling import SamplingParams


def seeded_sampler(sampling: SamplingParams, seed: int) -> Callable[[mx.array], mx.array]:
    """A sampler over log-probabilities `[1, V]` whose draws depend only on `seed` and the inputs."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    key = mx.random.key(seed)
    inverse_temperature = 1.0 / sampling.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw_key = mx.random.split(key)
        if 0.0 < sampling.top_p < 1.0:
            logprobs = apply_top_p(logprobs, sampling.top_p)
        if sampling.min_p > 0.0:
            logprobs = apply_min_p(logprobs, sampling.min_p)
        if sampling.top_k_filters(logprobs.shape[-1]):
            logprobs = apply_top_k(logprobs, sampling.top_k)
        return mx.random.categorical(logprobs * inverse_temperature, key=draw_key)

    return sample


def install_seeded_sampler(engine: Any, request_id: str, sampling: SamplingParams) -> None:
    """Give a queued request its own seeded sampler (engine thread only). Greedy or unseeded: nothing to do."""
    if sampling.seed is None or sampling.greedy:
        return
    if engine.lookup(request_id) is not None:
        engine.set_sampler(request_id, seeded_sampler(sampling, sampling.seed))
