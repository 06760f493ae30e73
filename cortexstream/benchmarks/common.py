"""Shared benchmark helpers: real-text prompts, percentiles, the options every benchmark has, and the report
files (JSON + Markdown + optional PNG). The machine record is `machine.py`, the resumable store `result_store.py`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

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


def release_engines(engines: dict[Any, Any]) -> None:
    """Close every engine of a measurement and give their memory back before the next one starts."""
    import gc

    import mlx.core as mx

    for engine in engines.values():
        engine.close()
    engines.clear()
    gc.collect()
    mx.clear_cache()


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


def write_report(out_dir: str, name: str, payload: dict[str, Any], markdown: str,
                 plot: Callable[[dict[str, Any], str], bool | None] | None = None) -> None:
    """`<name>.json` and `<name>.md` (atomically), then `plot(payload, "<name>.png")` when given. A plot needs
    matplotlib (the `bench` extra); without it the JSON and Markdown are still written and the missing PNG is said."""
    write_results(out_dir, name, payload, markdown)
    if plot is None:
        return
    png = os.path.join(out_dir, f"{name}.png")
    try:
        plot(payload, png)
    except ImportError:
        print(f"{name}: no PNG plot ({png}): matplotlib is missing; pip install 'cortexstream[bench]'", file=sys.stderr)


def show_report(out_dir: str, name: str) -> int:
    """Print `<out_dir>/<name>.md` (what a benchmark just wrote) and return the command's exit status, 0."""
    with open(os.path.join(out_dir, f"{name}.md"), encoding="utf-8") as f:
        print(f.read())
    return 0


def add_run_options(parser: argparse.ArgumentParser, quick_help: str, *, resume: bool = True) -> None:
    """The options of the long, resumable benchmarks: --quick, --max-minutes, --resume, --model and --out."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no new cell after this many minutes (skipped cells are listed as missing)")
    if resume:
        parser.add_argument("--resume", action="store_true", help="keep cells already in the JSON, run the rest")
    parser.add_argument("--model", default=None, help="model to measure (default: smollm2-135m)")
    parser.add_argument("--out", default="bench/results", help="output folder")


def policy_specs(text: str) -> tuple[str, ...]:
    """A semicolon-separated list of policy strings (`"full;h2o:budget=0.2"`), blanks dropped."""
    return tuple(p.strip() for p in text.split(";") if p.strip())


class NoEosTokenizer:
    """The model's tokenizer with an end-of-sequence id no token has, so that no request ends early and every
    timed step decodes the whole batch. Everything else is the wrapped tokenizer's."""

    eos_token_ids = (-1,)  # token ids are >= 0
    eos_token_id = -1

    def __init__(self, tokenizer: Any) -> None:
        self.wrapped = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)
