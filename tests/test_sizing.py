"""Private engines are sized to the job: context caps, memory caps with the numbers, arenas no bigger than needed."""

from __future__ import annotations

import warnings

import pytest

import cortexstream
from cortexstream.engine import engine as engine_module
from cortexstream.engine import sizing
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import FullCache
from cortexstream.policies.parsing import parse_policy


def spy_arena_tokens(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = engine_module.Engine.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sizes.append(self.arena.config.num_slots)
        # A private engine's job-sized arena is committed at once (one zero-fill, never grown in doublings).
        assert self.arena.stats()["num_physical_blocks"] == self.arena.config.num_blocks

    monkeypatch.setattr(engine_module.Engine, "__init__", spy)
    return sizes


def test_job_tokens_are_whole_blocks_plus_one_each_and_respect_policy_bounds():
    full = FullCache()
    assert sizing.job_kv_tokens([(10, 6, full)], 16, 512) == 2 * 16  # 16 tokens: 1 block + 1 copy-on-write
    assert sizing.job_kv_tokens([(10, 7, full), (1, 1, full)], 16, 512) == (2 + 1) * 16 + (1 + 1) * 16
    bounded = parse_policy("streaming:window=64")
    bound = bounded.max_physical_tokens(5000, 32)
    assert bound < 200 and sizing.job_kv_tokens([(4000, 1000, bounded)], 16, 32) == (-(-bound // 16) + 1) * 16


def test_batch_generate_arena_is_what_the_job_needs(tiny, monkeypatch):
    model, tokenizer = tiny
    sizes = spy_arena_tokens(monkeypatch)
    prompts = [[5] * 20, [6] * 30, [7] * 9]
    response = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=12)
    assert all(r in ("stop", "length") for r in response.finish_reasons)
    expected = sum((-(-(len(p) + 12) // 16) + 1) * 16 for p in prompts)
    assert sizes == [expected]


def test_generate_arena_is_what_the_request_needs(tiny, monkeypatch):
    model, tokenizer = tiny
    sizes = spy_arena_tokens(monkeypatch)
    cortexstream.generate(model, tokenizer, [5] * 40, max_tokens=8)
    assert sizes == [(-(-48 // 16) + 1) * 16]


def test_max_tokens_is_cut_to_the_models_context(tiny, monkeypatch):
    model, tokenizer = tiny
    context = sizing.model_context(model)
    assert context == 2048
    assert sizing.fit_to_context(model, 40, 10**9) == context - 40
    assert sizing.fit_to_context(model, 40, 5) == 5
    sizes = spy_arena_tokens(monkeypatch)
    stream = cortexstream.stream_generate(model, tokenizer, [5] * 40, max_tokens=10**9)
    next(iter(stream))
    stream.close()
    assert sizes == [(context // 16 + 1) * 16]  # the context, not 10**9 tokens
    with pytest.raises(InvalidArgumentError):
        sizing.fit_to_context(model, 40, 5, on_overflow="ignore")


def test_a_prompt_longer_than_the_context_warns_or_is_refused(tiny):
    model, tokenizer = tiny
    long_prompt = [5] * 2100
    with pytest.raises(InvalidArgumentError, match="2100 tokens, longer than the model's context of 2048"):
        cortexstream.generate(model, tokenizer, long_prompt, max_tokens=2, context_overflow="error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cortexstream.generate(model, tokenizer, long_prompt, max_tokens=2)
    assert any("longer than the model's context" in str(w.message) for w in caught)


def test_a_request_larger_than_memory_is_refused_with_the_numbers(tiny, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: 1_000_000)
    with pytest.raises(InvalidArgumentError, match=r"max_tokens: a request needs \d+ KV slots x \d+ bytes"):
        cortexstream.generate(model, tokenizer, [5] * 40, max_tokens=1500)


def test_many_requests_beyond_memory_share_a_capped_arena(tiny, monkeypatch):
    model, tokenizer = tiny
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: int(200 * per_token / sizing.MEMORY_SHARE) + 1)
    sizes = spy_arena_tokens(monkeypatch)
    prompts = [[5 + i] * 40 for i in range(6)]
    response = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=20)
    assert sizes == [192]  # 200 slots of memory, in whole 16-token blocks: requests take turns
    assert all(r in ("stop", "length") for r in response.finish_reasons)
    assert response.texts == [cortexstream.generate(model, tokenizer, p, max_tokens=20) for p in prompts]
