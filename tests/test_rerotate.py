"""StreamingLLM(rerotate=True): kept keys are moved to positions 0..n-1 with the model's RoPE."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import StreamingLLM, parse_policy
from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.engine.rerotate import find_rope
from test_policies_runtime import engine_run
from tiny_models import random_token_ids


def test_parse_and_describe():
    policy = parse_policy("streaming:budget=32,rerotate=1")
    assert policy == StreamingLLM(budget=32, rerotate=True)
    assert parse_policy(policy.describe()) == policy


def test_renumbered_keys_equal_a_fresh_prefill_of_the_kept_tokens(sharp):
    """Layer 0's keys depend only on token and position: after re-rotation they must equal the keys a fresh
    prefill computes for the kept tokens at positions 0..n-1."""
    model, _ = sharp
    tokens = random_token_ids(61)
    policy = StreamingLLM(sinks=3, budget=20, rerotate=True)
    seen = {}

    def inspect(stop, cache):
        seq = cache[0].sequence
        seen["keys"] = np.array(seq.arena.read(0, seq.blocks, seq.num_tokens)[0])
        seen["offset"], seen["n"] = cache[0].offset, seq.num_tokens
        seen["stop"] = stop

    token_nlls(model, tokens, policy, chunk_size=1, on_chunk=inspect)
    n, stop = seen["n"], seen["stop"]
    assert seen["offset"] == n and 18 <= n <= 20  # positions continue from the cache size, not the logical length
    kept = tokens[:3] + tokens[stop - (n - 3) : stop]  # sinks + the window that ends at the last scored token
    fresh = make_prompt_cache(model)
    model(mx.array(kept, dtype=mx.uint32)[None], cache=fresh)
    seq = fresh[0].sequence
    expected = np.array(seq.arena.read(0, seq.blocks, seq.num_tokens)[0])
    np.testing.assert_allclose(seen["keys"], expected, atol=2e-5)


def test_without_rerotate_positions_keep_growing(sharp):
    model, _ = sharp
    offsets = []
    token_nlls(model, random_token_ids(61), StreamingLLM(sinks=3, budget=20), chunk_size=1,
               on_chunk=lambda stop, cache: offsets.append(cache[0].offset))
    assert offsets[-1] == 60


def test_needs_the_model_and_a_pure_rotation(sharp):
    model, _ = sharp
    cache = make_prompt_cache(model)
    direct.attach_policy(cache, StreamingLLM(sinks=2, budget=8, rerotate=True))  # no model given
    model(mx.array(random_token_ids(12), dtype=mx.uint32)[None], cache=cache)
    with pytest.raises(InvalidArgumentError, match="model"):
        direct.apply_policy(cache, 12)

    class Odd:
        class model:  # noqa: N801 - mimics mlx-lm's attribute layout
            layers = [type("L", (), {"self_attn": type("A", (), {"rope": object()})()})()]

    with pytest.raises(InvalidArgumentError, match="pure rotation"):
        find_rope(Odd())


def test_engine_runs_rerotate_within_budget(sharp):
    model, tokenizer = sharp
    policy = StreamingLLM(sinks=2, budget=24, rerotate=True)
    tokens, _, physical, engine = engine_run(model, tokenizer, [random_token_ids(70)], [policy], max_tokens=20,
                                             prefill_step_size=16)
    assert len(tokens[0]) == 20 and max(p for p, _ in physical[0]) <= 24
    assert engine.arena.allocator.num_used_blocks == 0
