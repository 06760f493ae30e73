"""Speculative decoding settings and their string form for the API, the CLI and the server.

Forms: `ngram` (prompt lookup: propose the continuation of the latest earlier match of the last n tokens in the
prompt and the output so far), `ngram:k=4,n=3`, `ngram:k=6,adaptive=0`, `draft:model=PATH,k=4` (a smaller model
with the same tokenizer drafts). `off` / `none` / None turn speculation off. Errors name `speculative`, the bad
key or value, and list the accepted forms.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError

K_RANGE = (1, 16)  # drafted tokens per verify step
N_RANGE = (1, 8)  # longest n-gram prompt lookup matches
DEFAULT_K = 4
DEFAULT_N = 3
ACCEPTED_FORMS = ("accepted forms: off | none | ngram | ngram:k=K,n=N[,adaptive=0|1] | "
                  f"draft:model=PATH[,k=K][,adaptive=0|1] (k in {K_RANGE[0]}..{K_RANGE[1]}, "
                  f"n in {N_RANGE[0]}..{N_RANGE[1]})")
_OFF = ("off", "none")


class SpeculativeMethod(enum.Enum):
    NGRAM = "ngram"  # prompt lookup in the sequence's own tokens, no second model
    DRAFT = "draft"  # a smaller model proposes


# The keys each method's string form takes.
_KEYS: dict[SpeculativeMethod, tuple[str, ...]] = {
    SpeculativeMethod.NGRAM: ("k", "n", "adaptive"),
    SpeculativeMethod.DRAFT: ("model", "k", "adaptive"),
}


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"speculative: {message}; {ACCEPTED_FORMS}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request speculates. `k`: the most tokens drafted per step (adaptive k chooses 0..k per sequence from
    its acceptance rate when `adaptive`, else always k). `n`: the longest n-gram prompt lookup matches (ngram
    only). `model`: the draft model's source (draft only)."""

    method: SpeculativeMethod
    k: int = DEFAULT_K
    n: int = DEFAULT_N
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        method = self.method
        if isinstance(method, str) and not isinstance(method, SpeculativeMethod):
            try:
                method = SpeculativeMethod(method.strip().lower())
            except ValueError:
                raise _bad(f"unknown method {self.method!r}") from None
            object.__setattr__(self, "method", method)
        if not isinstance(method, SpeculativeMethod):
            raise _bad(f"method={self.method!r} must be a SpeculativeMethod")
        if not _is_int(self.k) or not K_RANGE[0] <= self.k <= K_RANGE[1]:
            raise _bad(f"k={self.k!r} must be an integer in {K_RANGE[0]}..{K_RANGE[1]}")
        if not _is_int(self.n) or not N_RANGE[0] <= self.n <= N_RANGE[1]:
            raise _bad(f"n={self.n!r} must be an integer in {N_RANGE[0]}..{N_RANGE[1]}")
        if not isinstance(self.adaptive, bool):
            raise _bad(f"adaptive={self.adaptive!r} must be a bool")
        if method is SpeculativeMethod.NGRAM:
            if self.model is not None:
                raise _bad(f"model={self.model!r} is for draft only (ngram drafts from the sequence's own tokens)")
            return
        if self.n != DEFAULT_N:
            raise _bad(f"n={self.n!r} is for ngram only (a draft model does not match n-grams)")
        if self.model is None:
            raise _bad("draft needs model=PATH (the draft model's source)")
        model = self.model
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
            object.__setattr__(self, "model", model)
        if not isinstance(model, str) or not model.strip():
            raise _bad(f"model={self.model!r} must be a non-empty path or model name")
        if "," in model:
            raise _bad(f"model={model!r} contains ',', which separates keys in the string form")

    @property
    def text(self) -> str:
        """The canonical string form; `parse_speculative(config.text) == config`."""
        if self.method is SpeculativeMethod.NGRAM:
            parts = [f"k={self.k}", f"n={self.n}"]
        else:
            parts = [f"model={self.model}", f"k={self.k}"]
        if not self.adaptive:
            parts.append("adaptive=0")
        return f"{self.method.value}:{','.join(parts)}"


def _int_value(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _bad(f"{key}={text!r} is not an integer") from None


def _bool_value(key: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise _bad(f"{key}={text!r} is not a boolean (0/1/true/false)")


def parse_speculative(value: "str | SpeculativeConfig | None") -> SpeculativeConfig | None:
    """A SpeculativeConfig from its string form; configs pass through, None / 'off' / 'none' mean no
    speculation (None)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, str):
        raise _bad(f"expected a string or a SpeculativeConfig, got {type(value).__name__}")
    spec = value.strip()
    if spec.lower() in _OFF:
        return None
    name, colon, rest = spec.partition(":")
    try:
        method = SpeculativeMethod(name.strip().lower())
    except ValueError:
        raise _bad(f"unknown method {name.strip()!r} in {value!r}") from None
    if colon and not rest.strip():
        raise _bad(f"{value!r} has ':' but no key=value after it")
    allowed = _KEYS[method]
    kwargs: dict[str, Any] = {}
    for item in (part.strip() for part in rest.split(",")) if colon else ():
        key, eq, text = item.partition("=")
        key, text = key.strip().lower(), text.strip()
        if not item:
            raise _bad(f"empty item in {value!r}")
        if not eq or not key or not text:
            raise _bad(f"{item!r} in {value!r} must be key=value")
        if key not in allowed:
            raise _bad(f"unknown key {key!r} for {method.value} in {value!r} (known: {', '.join(allowed)})")
        if key in kwargs:
            raise _bad(f"key {key!r} given twice in {value!r}")
        if key == "model":
            kwargs[key] = text
        elif key == "adaptive":
            kwargs[key] = _bool_value(key, text)
        else:
            kwargs[key] = _int_value(key, text)
    return SpeculativeConfig(method, **kwargs)
