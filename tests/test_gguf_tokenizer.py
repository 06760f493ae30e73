"""Tests for cortexstream.models.gguf_tokenizer on small synthetic byte-level ("gpt2") metadata, and its errors.

Independent reference: the published split regexes run by the `regex` module (pre-tokenizers).
SentencePiece ("llama") path: test_gguf_tokenizer_spm.py; the real SmolLM2 GGUF: test_gguf_tokenizer_real.py.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortexstream.errors import ModelLoadError, UnsupportedModelError
from cortexstream.models.gguf_tokenizer import build_gguf_tokenizer
from gguf_tokenizer_helpers import SRC, u32


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]  # types 3, 3, 3, 4
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "1 2", "12 3", "Ġ Ġ"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)




def byte_level_metadata(pre: str = "smollm", **extra: Any) -> dict[str, Any]:
    """Metadata shaped like mx.load's: strings, lists of strings, mx.array scalars/vectors."""
    tokens = SPECIALS + _byte_chars()
    tokens += [m.replace(" ", "") for m in MERGES] + ["ab"]  # "ab" has no merge: only reachable via ignore_merges
    types = [3, 3, 3, 4] + [1] * (len(tokens) - 4)
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.padding_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def synth():
    return build_gguf_tokenizer(byte_level_metadata(), SRC)


def test_special_tokens_are_never_split(synth) -> None:
    ids = synth.encode("<|im_start|>user\nhello<|im_end|><tool>", add_special_tokens=False)
    vocab = synth.get_vocab()
    assert ids[0] == 1 and ids[-2:] == [2, 3]
    assert vocab["hello"] in ids
    assert synth.decode(ids) == "<|im_start|>user\nhello<|im_end|><tool>"
    # Control tokens are special (skippable); the user-defined token is ordinary text.
    assert synth.decode(ids, skip_special_tokens=True) == "user\nhello<tool>"


def test_smollm_splits_every_digit_but_gpt2_does_not() -> None:
    vocab_id = build_gguf_tokenizer(byte_level_metadata(), SRC).get_vocab()
    smollm = build_gguf_tokenizer(byte_level_metadata("smollm"), SRC)
    gpt2 = build_gguf_tokenizer(byte_level_metadata("gpt-2"), SRC)
    assert smollm.encode("123", add_special_tokens=False) == [vocab_id["1"], vocab_id["2"], vocab_id["3"]]
    assert gpt2.encode("123", add_special_tokens=False) == [vocab_id["123"]]
    for tok in (smollm, gpt2):
        assert tok.encode(" world", add_special_tokens=False) == [vocab_id["Ġwor"], vocab_id["ld"]]


def _pre_split(tok: Any, text: str) -> list[str]:
    return [piece for piece, _ in tok._tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre, expected",
    [
        # Llama-3: digits in groups of three, case-insensitive contractions, punctuation keeps its newline.
        ("llama-bpe", ["I", "'M", "Ġ", "123", "45", "Ġok", ".ĊĊ", "x"]),
        ("qwen2", ["I", "'M", "Ġ", "1", "2", "3", "4", "5", "Ġok", ".ĊĊ", "x"]),
        # GPT-2's `\s+(?!\S)` leaves the last newline before a word on its own.
        ("gpt-2", ["I", "'", "M", "Ġ12345", "Ġok", ".", "Ċ", "Ċ", "x"]),
        ("starcoder", ["I", "'", "M", "Ġ", "1", "2", "3", "4", "5", "Ġok", ".", "Ċ", "Ċ", "x"]),
    ],
)
def test_pre_tokenizer_splits(pre: str, expected: list[str]) -> None:
    tok = build_gguf_tokenizer(byte_level_metadata(pre), SRC)
    assert _pre_split(tok, "I'M 12345 ok.\n\nx") == expected


# The split regexes as published (llama.cpp's list; Llama-3/Qwen2 with their tokenizer.json's (?i:...)
# contractions), run by the third-party `regex` module: an independent statement of each pipeline.
_RX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_RX_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_REFERENCE = {
    "gpt-2": lambda rx, t: rx.findall(_RX_GPT2, t),
    # \p{N} split first, then GPT-2's regex on each piece.
    "smollm": lambda rx, t: [w for part in rx.split(r"(\p{N})", t) if part for w in rx.findall(_RX_GPT2, part)],
    "llama-bpe": lambda rx, t: rx.findall(_RX_LLAMA3, t),
    "qwen2": lambda rx, t: rx.findall(_RX_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}"), unicodedata.normalize("NFC", t)),
}
_BYTE_OF = {c: b for b, c in enumerate(_byte_chars())}


@pytest.mark.parametrize("pre", sorted(_RX_REFERENCE))
def test_pre_tokenizer_matches_regex_reference(pre: str) -> None:
    rx = pytest.importorskip("regex")
    tok = build_gguf_tokenizer(byte_level_metadata(pre), SRC)
    # Unassigned code points are excluded: the two libraries ship different Unicode versions.
    text_st = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cn",)), max_size=60) | st.from_regex(
        r"[ \t\r\n0-9a-zA-Z.,'!?<|>_éÉ😀½]{0,60}", fullmatch=True
    )

    @settings(max_examples=150, deadline=None)
    @given(text=text_st)
    def check(text: str) -> None:
        pieces = [
            bytes(_BYTE_OF[c] for c in piece).decode()
            for piece in _pre_split(tok, unicodedata.normalize("NFC", text) if pre == "qwen2" else text)
        ]
        assert pieces == _RX_REFERENCE[pre](rx, text)

    check()


def test_llama3_matches_whole_vocab_words_before_merging() -> None:
    # Llama-3's tokenizer.json sets ignore_merges: a pre-token that is a vocab entry is emitted as is.
    vocab = build_gguf_tokenizer(byte_level_metadata(), SRC).get_vocab()
    llama3 = build_gguf_tokenizer(byte_level_metadata("llama-bpe"), SRC)
    gpt2 = build_gguf_tokenizer(byte_level_metadata("gpt-2"), SRC)
    assert llama3.encode("ab", add_special_tokens=False) == [vocab["ab"]]
    assert gpt2.encode("ab", add_special_tokens=False) == [vocab["a"], vocab["b"]]
    # llama.cpp adds bos by default for Llama-3 files; the file's explicit flag wins.
    md = byte_level_metadata("llama-bpe")
    del md["tokenizer.ggml.add_bos_token"]
    assert build_gguf_tokenizer(md, SRC).encode("ab") == [1, vocab["ab"]]


def test_qwen2_normalizes_to_nfc() -> None:
    tok = build_gguf_tokenizer(byte_level_metadata("qwen2"), SRC)
    assert tok.encode("e\u0301", add_special_tokens=False) == tok.encode("\u00e9", add_special_tokens=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_byte_level_roundtrip(synth, text: str) -> None:
    assert synth.decode(synth.encode(text, add_special_tokens=False)) == text


def test_bos_eos_flags_and_names() -> None:
    tok = build_gguf_tokenizer(byte_level_metadata(), SRC)
    assert tok.encode("he", add_special_tokens=True) == tok.encode("he", add_special_tokens=False)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>"
    )
    md = byte_level_metadata(**{"tokenizer.ggml.add_bos_token": mx.array(True), "tokenizer.ggml.add_eos_token": mx.array(True)})
    he = tok.get_vocab()["he"]
    assert build_gguf_tokenizer(md, SRC).encode("he") == [1, he, 2]


def test_end_of_turn_token_stops_generation() -> None:
    # eos is <|endoftext|>, but the chat template ends turns with the control token <|im_end|>.
    tok = build_gguf_tokenizer(byte_level_metadata(**{"tokenizer.ggml.eos_token_id": u32(0)}), SRC)
    assert tok.eos_token_ids == {0, 2}
    md = byte_level_metadata(**{"tokenizer.ggml.eos_token_id": u32(0), "tokenizer.chat_template": "{{ messages }}"})
    assert build_gguf_tokenizer(md, SRC).eos_token_ids == {0}


def test_chat_template_and_streaming_detokenizer(synth) -> None:
    msgs = [{"role": "user", "content": "hello world"}]
    text = synth.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    ids = synth.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == synth.encode(text, add_special_tokens=False)
    detok = synth.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text


# --------------------------------------------------------------------------- errors


def test_missing_tokenizer_metadata() -> None:
    md = byte_level_metadata()
    del md["tokenizer.ggml.tokens"]
    with pytest.raises(ModelLoadError, match=rf"^{SRC}: GGUF has no tokenizer metadata \(tokenizer\.ggml\.tokens missing\)"):
        build_gguf_tokenizer(md, SRC)
    with pytest.raises(ModelLoadError, match=rf"{SRC}: GGUF has no tokenizer metadata"):
        build_gguf_tokenizer({"general.architecture": "llama"}, SRC)


def test_unknown_pre_tokenizer() -> None:
    with pytest.raises(UnsupportedModelError, match=rf"^{SRC}: unsupported GGUF pre-tokenizer tokenizer\.ggml\.pre='klingon'"):
        build_gguf_tokenizer(byte_level_metadata("klingon"), SRC)


def test_unsupported_model_type() -> None:
    md = byte_level_metadata(**{"tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match=rf"^{SRC}: unsupported GGUF tokenizer model tokenizer\.ggml\.model='bert'"):
        build_gguf_tokenizer(md, SRC)


def test_broken_metadata() -> None:
    md = byte_level_metadata()
    del md["tokenizer.ggml.merges"]
    with pytest.raises(ModelLoadError, match=rf"^{SRC}: .*no tokenizer\.ggml\.merges"):
        build_gguf_tokenizer(md, SRC)
    md = byte_level_metadata(**{"tokenizer.ggml.merges": ["h e", "x zz"]})
    with pytest.raises(ModelLoadError, match=rf"^{SRC}: inconsistent GGUF vocab/merges"):
        build_gguf_tokenizer(md, SRC)
    md = byte_level_metadata(**{"tokenizer.ggml.eos_token_id": u32(99999)})
    with pytest.raises(ModelLoadError, match=rf"^{SRC}: tokenizer\.ggml\.eos_token_id=99999 is outside"):
        build_gguf_tokenizer(md, SRC)
    md = byte_level_metadata(**{"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelLoadError, match=rf"^{SRC}: .*tokenizer\.ggml\.scores"):
        build_gguf_tokenizer(md, SRC)

