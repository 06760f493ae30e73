"""Compressor weights are checked when the policy is built: non-finite values and unreadable files fail at once
with the file named, not as `<|endoftext|>` strings after a long prompt (issue #24 repro 8)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.errors import ModelLoadError
from cortexstream.policies import Compressor


def saved_compressor(path: str, poison: float | None = None) -> str:
    comp = KVCompressor(CompressorConfig(num_layers=1, head_dim=4, factor=2, image=False))
    if poison is not None:
        state = comp.state_dict()
        first = sorted(state)[0]
        state[first] = mx.full(state[first].shape, poison)
        comp.load_weights(list(state.items()))
    comp.save(path)
    return path


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_when_the_policy_is_built(tmp_path, poison):
    path = saved_compressor(str(tmp_path / f"bad{poison}.safetensors"), poison)
    with pytest.raises(ModelLoadError, match=r"bad.*\.safetensors: tensor '.*' holds \d+ NaN/inf values"):
        Compressor(factor=2, weights=path)


def test_weights_file_is_read_at_construction_even_if_never_used(tmp_path):
    path = tmp_path / "torn.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}")
    with pytest.raises(ModelLoadError, match="torn.safetensors"):
        Compressor(factor=2, weights=str(path))


def test_finite_weights_still_load(tmp_path):
    path = saved_compressor(str(tmp_path / "ok.safetensors"))
    policy = Compressor(factor=2, weights=path)
    assert policy.resolve(num_kv_heads=1, head_dim=4, num_layers=1).factor == 2
