"""Aligning two models for fusion: which sharer layer feeds which receiver layer, and which sharer token sits at
each receiver position.

Layers (source: thu-nics/C2C `rosetta/train/model_utils.py`, `last_aligned_sources` and `k_nearest_sources`; the
released recipes use `"mapping": "last_aligned"`, e.g. `recipe/train_recipe/C2C_0.6+0.5.json`): the receiver's last
layer reads the sharer's last layer, the second-to-last reads the second-to-last, and so on toward the front.
When the sharer is shallower, the reference clamps the receiver's extra front layers to sharer layer 0 (several
receiver layers read layer 0); `clamp=False` instead leaves them unfused, the paper's "until the shallower model
runs out" reading. We default to the reference code, since its checkpoints were trained that way.

Tokens (source: thu-nics/C2C `rosetta/model/aligner.py`, `TokenAligner`): the receiver's tokenization is the
base. Each receiver token is decoded to its string and re-encoded with the sharer's tokenizer; if that gives
several sharer tokens, one is chosen ("first", the reference default, or "longest" decoded string); special
tokens map by role (bos/eos/pad/unk), then by their literal text, else to the sharer's unk (or 0). The sharer then
runs on exactly one token per receiver position, so both caches have the same length and position i of one
corresponds to position i of the other. This loses the sharer's view of a word split differently (it sees only
one piece), which is the documented price of a 1:1 position map.
"""

from __future__ import annotations

from typing import Any, Sequence

from cortexstream.errors import InvalidArgumentError


def last_aligned(
    num_target_layers: int, num_source_layers: int, k: int = 1, clamp: bool = True
) -> dict[int, list[int]]:
    """{receiver layer: [sharer layers]}, last layers aligned; up to k sharer layers each (backward first)."""
    if num_target_layers <= 0 or num_source_layers <= 0 or k < 1:
        raise InvalidArgumentError(f"last_aligned: layer counts ({num_target_layers}, {num_source_layers}) and "
                                   f"k={k} must be positive")
    offset = num_source_layers - num_target_layers
    mapping: dict[int, list[int]] = {}
    for t in range(num_target_layers):
        anchor = offset + t
        if anchor < 0 and not clamp:
            continue
        anchor = min(max(anchor, 0), num_source_layers - 1)
        chosen = [s for s in range(anchor, anchor - k, -1) if s >= 0]
        nxt = anchor + 1
        while len(chosen) < k and nxt < num_source_layers:
            chosen.append(nxt)
            nxt += 1
        mapping[t] = chosen
    return mapping


def k_nearest(num_target_layers: int, num_source_layers: int, k: int = 1) -> dict[int, list[int]]:
    """{receiver layer: [sharer layers]} by relative depth in [0, 1] (the reference's alternative mapping)."""
    if num_target_layers <= 0 or num_source_layers <= 0 or k < 1:
        raise InvalidArgumentError("k_nearest: layer counts and k must be positive")

    def pos(i: int, n: int) -> float:
        return i / (n - 1) if n > 1 else 0.0

    def nearest(t: int) -> list[int]:
        depth = pos(t, num_target_layers)
        return sorted(range(num_source_layers), key=lambda s: abs(pos(s, num_source_layers) - depth))[:k]

    return {t: nearest(t) for t in range(num_target_layers)}


def _decode_one(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except TypeError:  # tokenizers without the HF keyword arguments
        return tokenizer.decode([token_id])


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", None) or [])


class TokenAligner:
    """Maps receiver token ids to one sharer token id each (see the module docstring for the strategy)."""

    STRATEGIES = ("first", "longest")

    def __init__(self, receiver_tokenizer: Any, sharer_tokenizer: Any, strategy: str = "first") -> None:
        if strategy not in self.STRATEGIES:
            raise InvalidArgumentError(f"strategy: {strategy!r} must be one of {self.STRATEGIES}")
        self.receiver = receiver_tokenizer
        self.sharer = sharer_tokenizer
        self.strategy = strategy
        self._cache: dict[int, int] = {}
        self.num_one_to_many = 0  # distinct receiver ids whose string needed several sharer tokens (loss indicator)

    def _role_map(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for role in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id"):
            r, s = getattr(self.receiver, role, None), getattr(self.sharer, role, None)
            if r is not None and s is not None and r not in out:
                out[int(r)] = int(s)
        return out

    def _fallback(self) -> int:
        unk = getattr(self.sharer, "unk_token_id", None)
        return int(unk) if unk is not None else 0

    def _special(self, token_id: int, text: str) -> int:
        mapped = self._role_map().get(token_id)
        if mapped is not None:
            return mapped
        convert = getattr(self.sharer, "convert_tokens_to_ids", None)
        if convert is not None:
            try:
                sid = convert(text)
                if sid is not None and sid != getattr(self.sharer, "unk_token_id", None):
                    return int(sid)
            except (KeyError, ValueError, TypeError):
                pass
        return self._fallback()

    def _choose(self, candidates: list[int]) -> int:
        if self.strategy == "first" or len(candidates) == 1:
            return candidates[0]
        lengths = [len(_decode_one(self.sharer, c)) for c in candidates]
        return candidates[lengths.index(max(lengths))]  # ties: the earliest, as the reference

    def map_token(self, token_id: int) -> int:
        token_id = int(token_id)
        if token_id in self._cache:
            return self._cache[token_id]
        text = _decode_one(self.receiver, token_id)
        if token_id in _special_ids(self.receiver):
            sid = self._special(token_id, text)
        else:
            candidates = _encode(self.sharer, text)
            if not candidates:
                sid = self._fallback()
            else:
                if len(candidates) > 1:
                    self.num_one_to_many += 1
                sid = self._choose(candidates)
        self._cache[token_id] = sid
        return sid

    def align(self, receiver_ids: Sequence[int]) -> list[int]:
        """Sharer ids, one per receiver id (same length, position i <-> position i)."""
        return [self.map_token(t) for t in receiver_ids]
