"""Per-head importance profiles of a model (`KVzipHeads`): how much each (layer, KV head) needs its whole context.

A profile is measured once per model, offline, by KVzip's own criterion (`cortexstream train head-profile`): the
model repeats calibration text, each context key gets the most attention any reconstruction query paid it, and a
head's importance is the mean of those maxima over its keys. A head that copies from far back (a retrieval head)
scores high on every key; a head that reads its sinks and the last few tokens scores near zero on most. The
scores of one model are stable across texts (two Wikipedia stretches correlate at 0.998 on SmolLM2-135M).

A profile is a JSON file: `model`, `layers`, `kv_heads`, `head_dim`, `scores` (`layers` lists of `kv_heads`
numbers) and `source` (how it was measured). Profiles for the models this project benchmarks ship in
`policies/profiles/`; a profile is matched to a cache by its shape (layers, KV heads), as shipped compressor
weights are.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from cortexstream.errors import InvalidArgumentError

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "profiles")


@dataclass(frozen=True)
class HeadProfile:
    model: str
    scores: tuple[tuple[float, ...], ...]  # [layers][kv_heads]
    head_dim: int
    source: str
    path: str = ""

    @property
    def layers(self) -> int:
        return len(self.scores)

    @property
    def kv_heads(self) -> int:
        return len(self.scores[0])

    def array(self) -> np.ndarray:
        return np.asarray(self.scores, dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "scores": [list(row) for row in self.scores], "source": self.source}


def profile_from(model: str, scores: Any, head_dim: int, source: str) -> HeadProfile:
    try:
        scores = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgumentError("head profile: scores must be a [layers, kv_heads] table of numbers") from None
    if scores.ndim != 2 or not scores.size or not np.isfinite(scores).all() or (scores < 0).any():
        raise InvalidArgumentError(f"head profile: scores must be finite, >= 0 and [layers, kv_heads], not "
                                   f"{scores.shape}")
    return HeadProfile(model, tuple(tuple(float(x) for x in row) for row in scores), int(head_dim), source)


@functools.lru_cache(maxsize=None)
def load_profile(path: str) -> HeadProfile:
    """A profile from its JSON file; errors name the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise InvalidArgumentError(f"head profile: cannot read '{path}': {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"head profile: '{path}' is not JSON: {exc}") from None
    missing = [k for k in ("model", "layers", "kv_heads", "head_dim", "scores", "source") if k not in data]
    if missing:
        raise InvalidArgumentError(f"head profile: '{path}' lacks {', '.join(missing)}")
    try:
        profile = profile_from(str(data["model"]), data["scores"], data["head_dim"], str(data["source"]))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"'{path}': {exc}") from None
    if (profile.layers, profile.kv_heads) != (data["layers"], data["kv_heads"]):
        raise InvalidArgumentError(f"head profile: '{path}' says {data['layers']}x{data['kv_heads']} but its scores "
                                   f"are {profile.layers}x{profile.kv_heads}")
    return HeadProfile(profile.model, profile.scores, profile.head_dim, profile.source, path)


def save_profile(profile: HeadProfile, path: str) -> None:
    from cortexstream.atomic_files import write_json_atomic

    write_json_atomic(path, profile.to_json(), indent=1)


def shipped_profiles() -> list[HeadProfile]:
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return [load_profile(os.path.join(SHIPPED_DIR, name)) for name in sorted(os.listdir(SHIPPED_DIR))
            if name.endswith(".json")]


def find_profile(layers: int, kv_heads: int, path: str | None = None) -> HeadProfile:
    """The profile at `path`, else the shipped one for this cache shape; it must fit the shape."""
    if path is not None:
        profile = load_profile(path)
        if (profile.layers, profile.kv_heads) != (layers, kv_heads):
            raise InvalidArgumentError(f"head profile '{path}' is for {profile.layers} layers x {profile.kv_heads} "
                                       f"KV heads ({profile.model}); this cache has {layers} x {kv_heads}")
        return profile
    for profile in shipped_profiles():
        if (profile.layers, profile.kv_heads) == (layers, kv_heads):
            return profile
    have = "; ".join(f"{p.model} ({p.layers}x{p.kv_heads})" for p in shipped_profiles()) or "none"
    raise InvalidArgumentError(f"kvzip_heads: no shipped head profile fits this model ({layers} layers x "
                               f"{kv_heads} KV heads); shipped: {have}. Measure one with `cortexstream train "
                               "head-profile --model MODEL --out FILE.json` and pass profile=FILE.json")


__all__ = ["HeadProfile", "SHIPPED_DIR", "find_profile", "load_profile", "profile_from", "save_profile",
           "shipped_profiles"]
