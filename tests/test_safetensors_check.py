"""The safetensors header check (the reference crate's rules), applied before mx.load by every reader."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import pytest

from cortexstream.errors import ModelLoadError
from cortexstream.models.safetensors_check import MAX_HEADER_BYTES, check_safetensors
from cortexstream.port import load_checkpoint, load_safetensors


def write_raw(path, header: dict, data: bytes, header_len: int | None = None) -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return str(path)


def good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "F16", "shape": [3], "data_offsets": [16, 22]}, "__metadata__": {"k": "v"}}


def test_files_written_by_mlx_pass(tmp_path):
    path = str(tmp_path / "ok.safetensors")
    mx.save_safetensors(path, {"x": mx.zeros((3, 4)), "y": mx.ones((0, 2)), "z": mx.ones((5,), dtype=mx.bfloat16)},
                        metadata={"m": "1"})
    layout = check_safetensors(path)
    assert layout.tensors["x"].shape == (3, 4) and layout.metadata == {"m": "1"}


def test_hand_built_valid_file_passes(tmp_path):
    layout = check_safetensors(write_raw(tmp_path / "h.safetensors", good_header(), b"\0" * 22))
    assert set(layout.tensors) == {"a", "b"}


@pytest.mark.parametrize("mutate, expected", [
    (lambda h: h["a"].update(dtype="F99"), "unknown dtype"),
    (lambda h: h["a"].update(shape=[2, -2]), "non-negative"),
    (lambda h: h["a"].update(shape="ab"), "non-negative"),
    (lambda h: h["a"].update(data_offsets=[0, 15]), "needs 16 bytes"),
    (lambda h: h["a"].update(data_offsets=[8, 4]), "begin <= end"),
    (lambda h: h["b"].update(data_offsets=[17, 23]), "gap"),
    (lambda h: h["b"].update(data_offsets=[10, 16]), "overlaps"),
    (lambda h: h.update(__metadata__={"k": 1}), "__metadata__"),
    (lambda h: h.update(c=[1, 2]), "not an object"),
])
def test_each_rule_is_enforced_naming_file_and_tensor(tmp_path, mutate, expected):
    header = good_header()
    mutate(header)
    path = write_raw(tmp_path / "bad.safetensors", header, b"\0" * 22)
    with pytest.raises(ModelLoadError, match=expected) as info:
        check_safetensors(path)
    assert str(info.value).startswith(path)


def test_trailing_bytes_and_truncation_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="trailing bytes"):
        check_safetensors(write_raw(tmp_path / "t.safetensors", good_header(), b"\0" * 23))
    with pytest.raises(ModelLoadError, match="truncated"):
        check_safetensors(write_raw(tmp_path / "u.safetensors", good_header(), b"\0" * 21))


def test_header_length_is_checked_against_the_file_and_the_100mb_cap(tmp_path):
    with pytest.raises(ModelLoadError, match="exceeds the file"):
        check_safetensors(write_raw(tmp_path / "a.safetensors", good_header(), b"\0" * 22, header_len=10**6))
    with pytest.raises(ModelLoadError, match="100 MB"):
        check_safetensors(write_raw(tmp_path / "b.safetensors", good_header(), b"", header_len=MAX_HEADER_BYTES + 1))
    short = tmp_path / "c.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ModelLoadError, match="shorter than"):
        check_safetensors(str(short))


def test_duplicate_keys_and_non_json_are_refused(tmp_path):
    raw = b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": {}}'
    path = tmp_path / "d.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(ModelLoadError, match="appears twice"):
        check_safetensors(str(path))
    path.write_bytes(struct.pack("<Q", 3) + b"\xff{[")
    with pytest.raises(ModelLoadError, match="not JSON"):
        check_safetensors(str(path))


def test_readers_check_before_mx_load(tmp_path):
    header = good_header()
    header["a"]["data_offsets"] = [0, 10**12]  # would make a trusting reader read far past the end
    path = write_raw(tmp_path / "w.safetensors", header, b"\0" * 22)
    for reader in (load_safetensors, load_checkpoint):
        with pytest.raises(ModelLoadError, match="needs 16 bytes"):
            reader(path)
