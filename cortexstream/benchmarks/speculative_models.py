"""The models `bench speculative` loads by name: a verified benchmark asset's name (`model_assets.BenchAsset`)
stands for its checked file, anything else (a GGUF file, a model directory, a hub id) is loaded as given. Used by
prompt-lookup runs (`speculative`) and draft-model runs (`speculative_pair`)."""

from __future__ import annotations

from typing import Any


def model_path(source: str) -> str:
    """What loads `source`: a `model_assets.BenchAsset` name's verified file (an AssetError saying how to fetch it
    when absent), anything else as given."""
    from cortexstream.benchmarks.model_assets import BenchAsset, qwen_coder_15b_gguf
    from cortexstream.training.c2c.sharer_asset import qwen_coder_gguf

    if source == BenchAsset.QWEN25_CODER_05B.value:
        return qwen_coder_gguf()
    if source == BenchAsset.QWEN25_CODER_15B.value:
        return qwen_coder_15b_gguf()
    return source


def load_model(source: str) -> tuple[Any, Any, dict[str, Any]]:
    """The model and tokenizer (`model_path(source)`) and its record for the results (no local paths)."""
    from cortexstream.benchmarks.machine import model_record
    from cortexstream.models.loader import load

    model, tokenizer = load(model_path(source))
    return model, tokenizer, model_record(model)


__all__ = ["load_model", "model_path"]
