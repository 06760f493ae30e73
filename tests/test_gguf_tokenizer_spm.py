"""Tests for cortexstream.models.gguf_tokenizer's SentencePiece ("llama") path.

Independent reference: the `sentencepiece` library itself, on models trained in the test.
"""

from __future__ import annotations

import io
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexstream.models.gguf_tokenizer import build_gguf_tokenizer
from gguf_tokenizer_helpers import SRC, pydoc_text, u32


def _train_spm(dummy_prefix: bool, user_defined: list[str]) -> Any:
    """A small SentencePiece BPE model, trained in ~0.1 s on stdlib docs."""
    spm = pytest.importorskip("sentencepiece")
    lines = [line for line in pydoc_text(0, 40).splitlines() if line.strip()]
    buf = io.BytesIO()
    # Llama's settings: BPE, byte fallback, no normalization, whitespace kept as is.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=1000, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
        user_defined_symbols=user_defined,
    )
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def _spm_metadata(sp: Any, dummy_prefix: bool, user_defined: list[str]) -> dict[str, Any]:
    """What llama.cpp's converter writes for a SentencePiece model."""
    n = sp.get_piece_size()
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
        else 4 if sp.id_to_piece(i) in user_defined else 1
        for i in range(n)
    ]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": mx.array([sp.get_score(i) for i in range(n)], dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.add_space_prefix": mx.array(dummy_prefix),
    }


# Llama-2 style (dummy prefix, no user-defined pieces) and Gemma style (no dummy prefix, user-defined
# pieces including one made of "▁" that SentencePiece matches in the normalized text).
SPM_STYLES = {"llama": (True, []), "gemma": (False, ["<tool>", "\u2581\u2581\u2581"])}


@pytest.fixture(scope="module", params=sorted(SPM_STYLES))
def spm_pair(request):
    dummy_prefix, user_defined = SPM_STYLES[request.param]
    sp = _train_spm(dummy_prefix, user_defined)
    return sp, build_gguf_tokenizer(_spm_metadata(sp, dummy_prefix, user_defined), SRC)


SPM_EDGE = [
    "", " ", "  leading", "trailing  ", "a    b", "a\n\n\tb", "émoji 😀 中文", "x = 1234567 + 0.5", "\u00a0nbsp",
    "a<tool>b", "x <tool> y", "<tool>  <tool>   x",
]


def test_spm_matches_sentencepiece(spm_pair) -> None:
    sp, tok = spm_pair
    for text in [pydoc_text(40, 20)] + SPM_EDGE:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text[:80]
        assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode("hi") == [1] + sp.encode("hi")  # llama.cpp adds bos by default for SentencePiece


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.from_regex(r"[ a-c<tool>]{0,30}", fullmatch=True))
def test_spm_matches_sentencepiece_random(spm_pair, text: str) -> None:
    sp, tok = spm_pair
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)


def test_spm_specials_and_detokenizer() -> None:
    sp = _train_spm(True, [])
    tok = build_gguf_tokenizer(_spm_metadata(sp, True, []), SRC)
    # Like llama.cpp (and HF's legacy Llama tokenizer.json), text after a special token gets its own
    # dummy-prefix space.  (SentencePiece itself never parses control tokens out of text.)
    ids = tok.encode("hello</s>world", add_special_tokens=False)
    assert ids == sp.encode("hello") + [2] + sp.encode("world")
    assert tok.decode(ids) == "hello</s> world"
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    detok = tok.detokenizer
    detok.reset()
    for i in sp.encode("The quick  brown\nfox 42"):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "The quick  brown\nfox 42"
