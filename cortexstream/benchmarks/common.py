"""Shared benchmark helpers: real-text prompts, percentiles, result files (the machine record: `machine.py`)."""

from __future__ import annotations

import os
from typing import Any

from cortexstream.atomic_files import write_json_atomic, write_text_atomic


def real_text(min_chars: int = 200_000) -> str:
    """Real English prose and code from the Python docs that ship with CPython (`pydoc_data`)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    while len(text) < min_chars:
        text += text
    return text


def prompt_token_lists(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` different real-text prompts of exactly `length` tokens."""
    tokens = tokenizer.encode(real_text())
    stride = max(length, 997)
    if count * stride + length > len(tokens):
        raise ValueError(f"not enough text for {count} prompts of {length} tokens")
    return [tokens[i * stride : i * stride + length] for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def write_results(out_dir: str, name: str, payload: dict[str, Any], markdown: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")
    write_json_atomic(json_path, payload)
    write_text_atomic(md_path, markdown)
    return json_path, md_path
