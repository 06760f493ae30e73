"""Helpers shared by the GGUF tokenizer tests (test_gguf_tokenizer*.py)."""

from __future__ import annotations

import mlx.core as mx

SRC = "/models/synthetic.gguf"


def u32(v: int) -> mx.array:
    return mx.array(v, dtype=mx.uint32)


def pydoc_text(first: int, count: int) -> str:
    from pydoc_data.topics import topics

    keys = sorted(topics)[first : first + count]
    return "\n".join(topics[k] for k in keys)
