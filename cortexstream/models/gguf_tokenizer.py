"""Build an mlx-lm ``TokenizerWrapper`` from the tokenizer metadata stored inside a GGUF file.

A GGUF file carries its whole tokenizer as ``tokenizer.ggml.*`` keys (vocab, merges or scores, token types,
special ids, pre-tokenizer name, chat template).  We rebuild the equivalent Hugging Face ``tokenizers``
pipeline from those facts so that a GGUF model needs no ``tokenizer.json`` and no network access:

* ``gpt2`` (byte-level BPE): vocab + merges from the file; the pre-tokenizer is chosen from
  ``tokenizer.ggml.pre`` to match what the model's original ``tokenizer.json`` (and llama.cpp) do.
* ``llama`` (SentencePiece BPE with byte fallback): merges are derived from the vocab and the per-token
  scores, the way SentencePiece's own BPE encoder ranks them (highest-scoring merged piece first).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from cortexstream.errors import ModelLoadError, UnsupportedModelError

__all__ = ["build_gguf_tokenizer"]

# llama.cpp / gguf-py token types (``tokenizer.ggml.token_type``).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible stand-in for a space.

# Llama-3's split regex (from its tokenizer.json; llama.cpp's LLAMA3 pre-type is the same expression with
# the contractions spelled out case by case).  Digits are grouped in runs of at most three.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 uses the same expression except that every digit is its own piece.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# Names a chat template uses to end a turn; such a control token must also stop generation.
_END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>", "<|end_of_turn|>")


class _PreSpec(NamedTuple):
    pre_tokenizer: Callable[[], Any]
    normalizer: Optional[Callable[[], Any]]
    ignore_merges: bool  # Llama-3's BPE emits a pre-token that is itself in the vocab without merging.
    add_bos: bool  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


def _gpt2_byte_level() -> Any:
    # GPT-2's own regex, applied by ByteLevel itself.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2() -> Any:
    # StarCoder/SmolLM: every digit is split off first, then the GPT-2 regex runs on what is left.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_byte_level()])


def _regex_then_bytes(regex: str) -> Callable[[], Any]:
    def make() -> Any:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )

    return make


_GPT2 = _PreSpec(_gpt2_byte_level, None, False, False)
_STARCODER = _PreSpec(_digits_then_gpt2, None, False, False)
_LLAMA3 = _PreSpec(_regex_then_bytes(_LLAMA3_REGEX), None, True, True)
# Qwen2's tokenizer.json NFC-normalises its input before splitting.
_QWEN2 = _PreSpec(_regex_then_bytes(_QWEN2_REGEX), normalizers.NFC, False, False)

# tokenizer.ggml.pre value -> pipeline.  Only names whose original tokenizer.json we know exactly.
_BPE_PRE: dict[str, _PreSpec] = {
    "default": _GPT2,  # written by converters that did not recognise the tokenizer; GPT-2 is the best guess
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
}


def _get(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as plain Python: mx.array scalars/vectors become ints/bools/floats/lists."""
    value = metadata.get(key)
    if value is None:
        return default
    return value.tolist() if hasattr(value, "tolist") else value


def _token_id(metadata: Mapping[str, Any], key: str, n_vocab: int, source: str) -> Optional[int]:
    value = _get(metadata, key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n_vocab:
        # Some converters write -1 / 0xFFFFFFFF for "none"; anything else out of range is a broken file.
        if value in (-1, 0xFFFFFFFF):
            return None
        raise ModelLoadError(f"{source}: {key}={value} is outside the vocabulary (size {n_vocab})")
    return value


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece BPE vocab, ranked like SentencePiece ranks them.

    SentencePiece repeatedly joins the adjacent pair whose joined piece has the highest score; a BPE
    merge list in which (left, right) is ranked by score(left + right) reproduces that.  Only normal
    pieces take part: control, byte and user-defined pieces are never produced by merging.
    """
    normal = {tok: i for i, tok in enumerate(tokens) if types[i] == _NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _build_backend(
    model_type: str, metadata: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> tuple[Tokenizer, Any, bool]:
    """The ``tokenizers.Tokenizer`` (without special tokens), its streaming detokenizer class (the one
    mlx-lm picks for the same decoder) and llama.cpp's default for add_bos."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if model_type == "gpt2":
        pre = _get(metadata, "tokenizer.ggml.pre", "default")
        spec = _BPE_PRE.get(pre)
        if spec is None:
            raise UnsupportedModelError(
                f"{source}: unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} "
                f"(supported: {', '.join(sorted(_BPE_PRE))})"
            )
        raw_merges = _get(metadata, "tokenizer.ggml.merges")
        if not raw_merges:
            raise ModelLoadError(f"{source}: GGUF BPE tokenizer has no tokenizer.ggml.merges")
        merges = []
        for line in raw_merges:
            # Byte-level tokens never contain a real space, so the first space separates the pair.
            left, sep, right = line.partition(" ")
            if not sep:
                raise ModelLoadError(f"{source}: malformed entry in tokenizer.ggml.merges: {line!r}")
            merges.append((left, right))
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
        except Exception as exc:  # tokenizers reports a merge naming an unknown token as a generic error
            raise ModelLoadError(f"{source}: inconsistent GGUF vocab/merges: {exc}") from exc
        backend = Tokenizer(bpe)
        if spec.normalizer is not None:
            backend.normalizer = spec.normalizer()
        backend.pre_tokenizer = spec.pre_tokenizer()
        backend.decoder = decoders.ByteLevel()
        return backend, BPEStreamingDetokenizer, spec.add_bos

    if model_type == "llama":
        scores = _get(metadata, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(f"{source}: GGUF SentencePiece tokenizer has no usable tokenizer.ggml.scores")
        unk_id = _token_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens), source)
        bpe = models.BPE(
            vocab=vocab,
            merges=_spm_merges(tokens, scores, types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,  # characters outside the vocab become <0xXX> byte pieces, as in SentencePiece
        )
        backend = Tokenizer(bpe)
        # SentencePiece's "dummy prefix": a space is prepended to each run of text, as llama.cpp does after
        # every special token too; spaces are then spelled "▁".  The decoder undoes both.
        add_prefix = bool(_get(metadata, "tokenizer.ggml.add_space_prefix", True))
        steps = [normalizers.Replace(" ", _SPM_SPACE)]
        dec = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            steps.insert(0, normalizers.Prepend(_SPM_SPACE))
            dec.append(decoders.Strip(" ", 1, 0))
        backend.normalizer = normalizers.Sequence(steps)
        backend.decoder = decoders.Sequence(dec)

        def detok(tok: Any) -> SPMStreamingDetokenizer:
            return SPMStreamingDetokenizer(tok, trim_space=add_prefix)

        return backend, detok, True

    raise UnsupportedModelError(
        f"{source}: unsupported GGUF tokenizer model tokenizer.ggml.model={model_type!r} "
        "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
    )


def build_gguf_tokenizer(metadata: dict, source: str) -> TokenizerWrapper:
    """Build the model's tokenizer from GGUF ``metadata`` (as returned by ``mx.load(..., return_metadata=True)``).

    ``source`` is the GGUF path and is only used in error messages.  Raises ``ModelLoadError`` when the
    tokenizer metadata is missing or inconsistent and ``UnsupportedModelError`` for tokenizer kinds we
    cannot reproduce exactly.
    """
    tokens = _get(metadata, "tokenizer.ggml.tokens")
    model_type = _get(metadata, "tokenizer.ggml.model")
    if not tokens or model_type is None:
        missing = "tokenizer.ggml.tokens" if not tokens else "tokenizer.ggml.model"
        raise ModelLoadError(
            f"{source}: GGUF has no tokenizer metadata ({missing} missing); "
            "it cannot be used without a separate tokenizer"
        )
    n_vocab = len(tokens)
    types = _get(metadata, "tokenizer.ggml.token_type") or [_NORMAL] * n_vocab
    if len(types) != n_vocab:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens"
        )

    backend, detokenizer_class, add_bos_default = _build_backend(model_type, metadata, tokens, types, source)

    ids = {
        name: _token_id(metadata, f"tokenizer.ggml.{name}_token_id", n_vocab, source)
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    # Control and unknown tokens are special (skipped by skip_special_tokens); user-defined ones are plain
    # added tokens.  Both are matched as a whole before BPE, so they are never split.  Control tokens match
    # the raw text, as llama.cpp parses them.  SentencePiece matches user-defined pieces (Gemma's "▁▁▁"...)
    # in the normalized text; we can do the same only without a dummy prefix, since tokenizers would
    # prepend "▁" to the piece itself too.  bos/eos/unk/pad are included even if a file mistypes them,
    # because transformers treats them as special anyway.
    match_normalized = model_type == "llama" and not _get(metadata, "tokenizer.ggml.add_space_prefix", True)
    named = {i for key, i in ids.items() if i is not None and key in ("bos", "eos", "unknown", "padding")}
    added = [
        AddedToken(
            tok,
            special=types[i] != _USER_DEFINED,
            normalized=match_normalized and types[i] == _USER_DEFINED,
        )
        for i, tok in enumerate(tokens)
        if tok and (types[i] in (_CONTROL, _UNKNOWN, _USER_DEFINED) or i in named)
    ]
    backend.add_tokens(added)

    add_bos = bool(_get(metadata, "tokenizer.ggml.add_bos_token", add_bos_default)) and ids["bos"] is not None
    add_eos = bool(_get(metadata, "tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None
    # Set the post-processor explicitly so encode(..., add_special_tokens=True) adds exactly what llama.cpp
    # adds for this file, nothing more.
    bos = [(tokens[ids["bos"]], ids["bos"])] if add_bos else []
    eos = [(tokens[ids["eos"]], ids["eos"])] if add_eos else []
    single = [t for t, _ in bos] + ["$A"] + [t for t, _ in eos]
    pair = single + [t + ":1" for t, _ in bos] + ["$B:1"] + [t + ":1" for t, _ in eos]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(bos + eos))
    )

    def name(key: str) -> Optional[str]:
        return tokens[ids[key]] if ids[key] is not None else None

    chat_template = _get(metadata, "tokenizer.chat_template")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=name("bos"),
        eos_token=name("eos"),
        unk_token=name("unknown"),
        pad_token=name("padding"),
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,  # decode must give back the exact text
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )

    # Generation must stop at the end of a chat turn even when the file's eos is a different token
    # (e.g. <|eot_id|> vs <|end_of_text|>): add the file's eot/eom ids and any end-of-turn control
    # token that the chat template actually emits.
    eos_ids = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    if chat_template:
        vocab = {tok: i for i, tok in enumerate(tokens)}
        for marker in _END_OF_TURN_NAMES:
            i = vocab.get(marker)
            if i is not None and types[i] == _CONTROL and marker in chat_template:
                eos_ids.append(i)
    return TokenizerWrapper(hf_tok, detokenizer_class, eos_token_ids=list(dict.fromkeys(eos_ids)))
