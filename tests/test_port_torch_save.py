"""`save_torch`: torch.save-compatible zips written without torch, checked against real torch and `load_torch`."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.errors import InvalidArgumentError
from cortexstream.port import load_checkpoint, load_torch, save_torch

torch = pytest.importorskip("torch")


def _tensors() -> dict[str, mx.array]:
    rng = np.random.default_rng(0)
    return {
        "layer.0.weight": mx.array(rng.normal(size=(5, 7)).astype(np.float32)),
        "layer.0.bias": mx.array(rng.normal(size=(5,)).astype(np.float16)),
        "emb": mx.array(rng.normal(size=(3, 2)).astype(np.float32)).astype(mx.bfloat16),
        "count": mx.array(np.array([2**40, -3], np.int64)),
        "small": mx.array(np.array([1, 2, 3], np.int8)),
        "flags": mx.array(np.array([True, False, True])),
        "scalar": mx.array(np.float32(2.5)),
        "empty": mx.zeros((0, 4)),
        "cube": mx.array(rng.normal(size=(2, 3, 4)).astype(np.float32)),
    }


def _as_numpy(t) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def test_real_torch_loads_it_weights_only_and_mmap(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "w.pth")
    save_torch(path, tensors)
    for kwargs in ({}, {"mmap": True}):  # mmap needs the 64-byte record alignment torch writes
        loaded = torch.load(path, weights_only=True, **kwargs)
        assert type(loaded).__name__ == "OrderedDict" and list(loaded) == list(tensors)
        for key, value in tensors.items():
            want = np.array(value.astype(mx.float32)) if value.dtype == mx.bfloat16 else np.array(value)
            got = loaded[key]
            assert tuple(got.shape) == value.shape
            assert str(got.dtype).rsplit(".", 1)[1] == str(value.dtype).rsplit(".", 1)[1]
            np.testing.assert_array_equal(_as_numpy(got), want)


def test_load_torch_reads_it_back_identically(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "w.pt")
    save_torch(path, tensors)
    back = load_torch(path)
    assert list(back) == list(tensors) and load_checkpoint(path).format == "torch-zip"
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        assert mx.array_equal(back[key], value).item(), key


def test_written_without_importing_torch(tmp_path):
    path = str(tmp_path / "w.pth")
    code = ("import sys; from cortexstream.port.torch_save import save_torch; import mlx.core as mx; "
            f"save_torch({path!r}, {{'a': mx.ones((2, 2))}}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(2, 2))
    with zipfile.ZipFile(path) as zf:
        assert all(info.compress_type == zipfile.ZIP_STORED for info in zf.infolist())


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="no tensors"):
        save_torch(str(tmp_path / "x.pth"), {})
    with pytest.raises(InvalidArgumentError, match="'u' has dtype uint32"):
        save_torch(str(tmp_path / "x.pth"), {"u": mx.array(np.array([1], np.uint32))})


def test_compressor_round_trip_pytorch_mlx_bin_mlx(tmp_path):
    """A reference-named torch state dict -> MLX (load_torch) -> InfiniLM .bin -> MLX: identical weights; and
    our own .pth export read by torch equals the MLX weights."""
    layers, d, f = 2, 8, 4
    g = torch.Generator().manual_seed(0)
    state = {}
    for prefix in ("compress_tk", "compress_tv"):
        for layer in range(layers):
            for idx, fan_in in ((0, d * f), (3, d), (6, d)):
                state[f"{prefix}.{layer}.{idx}.weight"] = torch.randn(d, fan_in, generator=g)
                state[f"{prefix}.{layer}.{idx}.bias"] = torch.randn(d, generator=g)
    torch.save({"compressor": state}, str(tmp_path / "ref.pth"))  # nested, as reference checkpoints are
    comp = KVCompressor.from_file(str(tmp_path / "ref.pth"))
    assert comp.config == CompressorConfig(layers, d, f, image=False)
    comp.save_infinilm_bin(str(tmp_path / "c.bin"), dtype="float32")
    again = KVCompressor.from_file(str(tmp_path / "c.bin"))
    for key, value in state.items():
        np.testing.assert_array_equal(np.array(again.state_dict()[key]), value.numpy())
    save_torch(str(tmp_path / "ours.pth"), again.state_dict())
    ours = torch.load(str(tmp_path / "ours.pth"), weights_only=True)
    assert set(ours) == set(state) and all(torch.equal(ours[k], state[k]) for k in state)
