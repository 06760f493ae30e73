"""Comma-separated options (`--contexts 2048,4096`, `--budgets 0.1,0.2`, `--tasks passkey,needle`): parsed and
range-checked before a benchmark loads anything, each error naming the option."""

from __future__ import annotations

import math

from cortexstream.errors import InvalidArgumentError


def name_list(text: str) -> tuple[str, ...]:
    """`text`'s comma-separated items, stripped, blanks dropped (the caller checks the names)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def int_list(text: str, option: str, minimum: int = 1) -> tuple[int, ...]:
    """`text` as integers >= `minimum`, at least one."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v < minimum for v in values):
        raise InvalidArgumentError(f"{option}: '{text}' must be integers >= {minimum} separated by commas")
    return values


def fraction_list(text: str, option: str) -> tuple[float, ...]:
    """`text` as fractions in (0, 1], at least one."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not math.isfinite(v) or not 0 < v <= 1 for v in values):
        raise InvalidArgumentError(f"{option}: '{text}' must be fractions in (0, 1] separated by commas")
    return values


def at_least(value: int, option: str, minimum: int) -> int:
    if value < minimum:
        raise InvalidArgumentError(f"{option}: {value} must be >= {minimum}")
    return value
