"""Pure name mapping, strict loading errors, InfiniLM `.bin` and safetensors I/O (no torch needed)."""

from __future__ import annotations

import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.port import (
    check_strict,
    load_checkpoint,
    load_safetensors,
    load_strict,
    map_state_dict,
    read_infinilm_bin,
    save_safetensors,
    write_infinilm_bin,
)
from cortexstream.port.infinilm_bin import HEADER, MAGIC


def test_map_state_dict_is_pure_and_renames():
    state = {"model.layers.0.w": 1, "model.layers.1.w": 2, "aux.head": 3, "keep": 4}
    out = map_state_dict(state, [(r"model\.layers\.(\d+)\.w", r"blocks.\1.weight")], drop=[r"aux\..*"],
                         transforms=[(r"blocks\.1\..*", lambda v: v * 10)])
    assert out == {"blocks.0.weight": 1, "blocks.1.weight": 20, "keep": 4}
    assert state == {"model.layers.0.w": 1, "model.layers.1.w": 2, "aux.head": 3, "keep": 4}
    with pytest.raises(ModelLoadError, match="'a.x' and 'b.x' both map to 'x'"):
        map_state_dict({"a.x": 1, "b.x": 2}, [(r"[ab]\.(x)", r"\1")], source="f.pt")


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.layers = [nn.Linear(2, 2, bias=False)]


def _state() -> dict[str, mx.array]:
    return {"proj.weight": mx.ones((2, 3)), "proj.bias": mx.zeros((2,)), "layers.0.weight": mx.full((2, 2), 2.0)}


def test_load_strict_loads_and_casts():
    model = load_strict(_Tiny(), _state(), "t.safetensors", dtype=mx.float16)
    assert model.layers[0].weight.dtype == mx.float16
    np.testing.assert_array_equal(np.array(model.proj.weight), np.ones((2, 3)))


@pytest.mark.parametrize("edit, pattern", [
    (lambda s: s.pop("proj.bias"), r"t\.pt: weights do not match _Tiny: missing keys 'proj.bias'"),
    (lambda s: s.update({"extra.w": mx.ones(1)}), r"unexpected keys 'extra.w'"),
    (lambda s: s.update({"proj.weight": mx.ones((3, 2))}),
     r"wrong shapes 'proj.weight' \(file \(3, 2\), expected \(2, 3\)\)"),
])
def test_strict_errors_name_the_key(edit, pattern):
    state = _state()
    edit(state)
    with pytest.raises(ModelLoadError, match=pattern):
        load_strict(_Tiny(), state, "t.pt")


def test_check_strict_reports_everything_at_once():
    with pytest.raises(ModelLoadError) as info:
        check_strict({"b": mx.ones(2), "c": mx.ones(3)}, {"a": (1,), "b": (3,)}, "f.bin")
    text = str(info.value)
    assert "missing keys 'a'" in text and "unexpected keys 'c'" in text and "'b' (file (2,)" in text


def _compressor_state(layers: int = 2, d: int = 4, f: int = 3, image: bool = True, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = {}
    for p in ("compress_tk", "compress_tv") + (("compress_ik", "compress_iv") if image else ()):
        for layer in range(layers):
            for slot, cols in ((0, d * f), (3, d), (6, d)):
                out[f"{p}.{layer}.{slot}.weight"] = mx.array(rng.standard_normal((d, cols)).astype(np.float32))
                out[f"{p}.{layer}.{slot}.bias"] = mx.array(rng.standard_normal(d).astype(np.float32))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("image", [True, False])
def test_bin_roundtrip(tmp_path, dtype, image):
    state = _compressor_state(image=image)
    path = str(tmp_path / "c.bin")
    header = write_infinilm_bin(path, state, min_seq_len=2, num_heads=3, dtype=dtype, metadata=b"hello")
    back_header, back = read_infinilm_bin(path)
    assert back_header == header
    assert (header.weight_count_per_layer, header.head_dim, header.hidden_size) == (12 if image else 6, 4, 12)
    assert header.compression_factor == 3 and header.min_seq_len == 2 and header.metadata == b"hello"
    assert set(back) == set(state)
    for key, value in state.items():
        assert back[key].dtype == {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
        want = np.array(value.astype(back[key].dtype).astype(mx.float32))
        np.testing.assert_array_equal(np.array(back[key].astype(mx.float32)), want)
    size = HEADER.size + 5 + 2 * (12 if image else 6) * 12 + sum(v.size for v in state.values()) * (
        4 if dtype == "float32" else 2)
    assert (tmp_path / "c.bin").stat().st_size == size


def _bin(tmp_path, **kw) -> tuple[str, bytes]:
    path = str(tmp_path / "c.bin")
    write_infinilm_bin(path, _compressor_state(layers=1, image=False), dtype="float32", **kw)
    return path, open(path, "rb").read()


def _rewrite(path: str, blob: bytes) -> None:
    with open(path, "wb") as f:
        f.write(blob)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<I", 2) + b[8:], "unsupported InfiniLM compressor format version 2"),
    (lambda b: b[:8] + struct.pack("<H", 9) + b[10:], "unknown dtype_code 9"),
    (lambda b: b[:20], r"truncated header \(20 bytes, need 44\)"),
    (lambda b: b[:-3], r"truncated in 'compress_tv.0.6.weight'"),
    (lambda b: b[:HEADER.size + 5], r"truncated before the meta of 'compress_tk.0.0.weight'"),
    (lambda b: b + b"\x00\x00", "2 unexpected trailing bytes"),
    (lambda b: b[:36] + struct.pack("<I", 7) + b[40:], "weight_count_per_layer=7"),
    (lambda b: b[:20] + struct.pack("<I", 5) + b[24:], "has 4 rows but header head_dim is 5"),
    (lambda b: b[:28] + struct.pack("<I", 2) + b[32:],
     r"'compress_tk.0.0.weight' has shape \(4, 12\), expected \(4, 8\)"),
    (lambda b: b[:40] + struct.pack("<I", 10**6) + b[44:], "metadata of 1000000 bytes runs past"),
])
def test_bin_header_validation(tmp_path, mutate, pattern):
    path, blob = _bin(tmp_path)
    _rewrite(path, mutate(blob))
    with pytest.raises(ModelLoadError, match=r"c\.bin: .*" + pattern):
        read_infinilm_bin(path)


def test_bin_writer_rejects_incomplete_state(tmp_path):
    state = _compressor_state(layers=2, image=False)
    del state["compress_tv.1.3.weight"]
    with pytest.raises(InvalidArgumentError, match="compress_tv.1.3.weight"):
        write_infinilm_bin(str(tmp_path / "x.bin"), state)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        write_infinilm_bin(str(tmp_path / "x.bin"), _compressor_state(), dtype="int8")


def test_bin_header_magic_constant(tmp_path):
    _, blob = _bin(tmp_path)
    assert struct.unpack("<I", blob[:4])[0] == MAGIC == 0x4B56434D and blob[:4] == b"MCVK"


def test_safetensors_and_sniffing(tmp_path):
    st = str(tmp_path / "w.safetensors")
    save_safetensors(st, {"a": mx.arange(3)}, {"factor": 4, "name": "x"})
    tensors, meta = load_safetensors(st)
    assert meta == {"factor": "4", "name": "x"} and np.array(tensors["a"]).tolist() == [0, 1, 2]
    path, _ = _bin(tmp_path, min_seq_len=3)
    ckpt = load_checkpoint(path)
    assert ckpt.format == "infinilm-bin" and ckpt.metadata["min_seq_len"] == "3" and ckpt.header is not None
    assert load_checkpoint(st).format == "safetensors"
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x01\x02\x03\x04garbage-garbage")
    with pytest.raises(ModelLoadError, match="junk.bin: unknown weight format"):
        load_checkpoint(str(junk))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="bad.safetensors"):
        load_safetensors(str(bad))
