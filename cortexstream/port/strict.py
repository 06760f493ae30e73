"""Name/shape mapping of ported state dicts, and strict loading into MLX modules.

Why two steps: renaming (`map_state_dict`) is a pure dict -> dict function, so every port (FastCache compressor,
C2C projectors, sidecars) is a small table of regex rules that can be unit-tested without files; loading
(`load_strict`) then insists that names and shapes match the module exactly. A silently ignored or missing key
would give a model that runs but computes garbage, so every mismatch is a `ModelLoadError` naming the keys.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from cortexstream.errors import ModelLoadError

V = TypeVar("V")
Shape = tuple[int, ...]
_LIST_LIMIT = 8


def map_state_dict(
    state: Mapping[str, V],
    rules: Sequence[tuple[str, str]] = (),
    *,
    drop: Sequence[str] = (),
    transforms: Sequence[tuple[str, Callable[[V], V]]] = (),
    source: str = "state dict",
) -> dict[str, V]:
    """Return a new dict with renamed keys and transformed values; the input is not modified.

    drop: regexes; a key that fully matches any of them is left out (e.g. training-only heads).
    rules: (regex, replacement) pairs; the first regex that fully matches a key renames it with
        `re.sub` semantics (`\\1` groups); keys no rule matches keep their name.
    transforms: (regex, fn) pairs matched against the *new* name; the first match maps the value
        (e.g. a transpose or reshape); at most one transform applies per key.
    Two keys mapping to the same name is a `ModelLoadError` naming both.
    """
    drops = [re.compile(p) for p in drop]
    compiled = [(re.compile(p), r) for p, r in rules]
    fns = [(re.compile(p), fn) for p, fn in transforms]
    out: dict[str, V] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        if any(d.fullmatch(key) for d in drops):
            continue
        new = key
        for pattern, repl in compiled:
            if pattern.fullmatch(key):
                new = pattern.sub(repl, key, count=1)
                break
        if new in out:
            raise ModelLoadError(f"{source}: keys '{origin[new]}' and '{key}' both map to '{new}'")
        for pattern, fn in fns:
            if pattern.fullmatch(new):
                value = fn(value)
                break
        out[new], origin[new] = value, key
    return out


def shapes_of(tree: nn.Module | Mapping[str, Any]) -> dict[str, Shape]:
    """Flattened 'a.b.0.weight' -> shape of a module's parameters (or of a flat/nested dict of arrays)."""
    params = tree.parameters() if isinstance(tree, nn.Module) else tree
    return {k: tuple(v.shape) for k, v in tree_flatten(params)}


def _names(keys: Sequence[str]) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:_LIST_LIMIT])
    return shown + (f" and {len(keys) - _LIST_LIMIT} more" if len(keys) > _LIST_LIMIT else "")


def check_strict(state: Mapping[str, Any], expected: Mapping[str, Shape], source: str, what: str = "the model") -> None:
    """Raise one `ModelLoadError` listing every missing, unexpected and mis-shaped key (none: return)."""
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    wrong = sorted(k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k]))
    if not (missing or unexpected or wrong):
        return
    parts = []
    if missing:
        parts.append(f"missing keys {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {_names(unexpected)}")
    if wrong:
        shown = [f"'{k}' (file {tuple(state[k].shape)}, expected {tuple(expected[k])})" for k in wrong[:_LIST_LIMIT]]
        more = f" and {len(wrong) - _LIST_LIMIT} more" if len(wrong) > _LIST_LIMIT else ""
        parts.append("wrong shapes " + ", ".join(shown) + more)
    raise ModelLoadError(f"{source}: weights do not match {what}: " + "; ".join(parts))


def load_strict(
    module: nn.Module,
    state: Mapping[str, mx.array],
    source: str,
    *,
    dtype: mx.Dtype | None = None,
    what: str | None = None,
) -> nn.Module:
    """Check `state` against `module`'s parameters exactly, then load it (cast to `dtype` when given)."""
    check_strict(state, shapes_of(module), source, what or type(module).__name__)
    items = [(k, v.astype(dtype) if dtype is not None else v) for k, v in state.items()]
    module.update(tree_unflatten(items))
    mx.eval(module.parameters())
    return module
