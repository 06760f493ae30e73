"""Torch-free reading of torch.save files: both formats, dtypes, views/shared storages, and refusal of code."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import zipfile

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import ModelLoadError
from cortexstream.port import load_checkpoint, load_torch

torch = pytest.importorskip("torch")


def _sample() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    tagged = torch.arange(3.0)  # a tensor with Python state pickles via torch._tensor._rebuild_from_type_v2
    tagged.note = "x"
    tagged_param = torch.nn.Parameter(torch.zeros(2))  # ... and a Parameter via _rebuild_parameter_with_state
    tagged_param.note = "y"
    return {
        "tagged": tagged,
        "tagged_param": tagged_param,
        "f32": base,
        "transposed": base.t(),  # non-contiguous view of the same storage
        "slice": base[1:3, 2:5],  # offset + strides into the same storage
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "bf16_t": torch.randn(5, 3, generator=g).to(torch.bfloat16).t(),
        "f16": torch.randn(2, 3, generator=g).half(),
        "i64": torch.arange(-5, 5),
        "i32": torch.tensor([1, -2, 2**31 - 1], dtype=torch.int32),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "u16": torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16),  # _rebuild_tensor_v3 path
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "nested": {"list": [torch.zeros(1), torch.full((2,), 7.0)], "epoch": 3, "name": "x"},
        "expanded": torch.ones(3, 1).expand(3, 4),  # stride 0
    }


def _lookup(tree, key):
    for part in key.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree.detach()


def _check(loaded: dict[str, mx.array], obj: dict) -> None:
    expected = {"f32", "transposed", "slice", "bf16", "bf16_t", "f16", "i64", "i32", "i8", "u8", "bool", "u16",
                "scalar", "empty", "param", "tagged", "tagged_param", "nested.list.0", "nested.list.1", "expanded"}
    assert set(loaded) == expected
    for key, got in loaded.items():
        want = _lookup(obj, key)
        assert tuple(got.shape) == tuple(want.shape), key
        if want.dtype == torch.bfloat16:
            assert got.dtype == mx.bfloat16
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want.float().numpy())
        else:
            assert np.array(got).dtype == want.numpy().dtype, key
            np.testing.assert_array_equal(np.array(got), want.numpy())


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_reads_real_torch_save(tmp_path, legacy):
    obj = _sample()
    path = str(tmp_path / "ckpt.pt")
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    _check(load_torch(path), obj)
    assert load_checkpoint(path).format == ("torch-legacy" if legacy else "torch-zip")


def test_reads_module_state_dict_with_tied_weights(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # one storage, two keys
    path = str(tmp_path / "tied.bin")  # HF-style name: content decides the format, not the extension
    torch.save(model.state_dict(), path)
    sd = load_torch(path)
    assert set(sd) == {"0.weight", "1.weight"}
    np.testing.assert_array_equal(np.array(sd["0.weight"]), np.array(sd["1.weight"]))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_malicious_torch_save_is_refused_not_executed(tmp_path, legacy):
    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "payload": _Evil(marker)}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ModelLoadError, match=r"evil\.pt.*refusing to unpickle global '(posix|os|nt)\.system'"):
        load_torch(path)
    assert not os.path.exists(marker)


def test_hand_made_malicious_pickles_are_refused(tmp_path):
    marker = str(tmp_path / "pwned")
    raw = str(tmp_path / "raw.pkl")
    with open(raw, "wb") as f:
        pickle.dump(_Evil(marker), f, protocol=2)
    with pytest.raises(ModelLoadError, match="system"):
        load_torch(raw)
    # same payload as the data.pkl of a zip checkpoint, and via builtins.eval
    for name, payload in (("zip_sys", pickle.dumps(_Evil(marker))),
                          ("zip_eval", b"cbuiltins\neval\n(Vopen('%s','w')\ntR." % marker.encode())):
        path = str(tmp_path / f"{name}.pt")
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("archive/data.pkl", payload)
        with pytest.raises(ModelLoadError, match="refusing to unpickle global"):
            load_torch(path)
    assert not os.path.exists(marker)


def test_pickle_cannot_set_state_on_storages(tmp_path):
    path = str(tmp_path / "build.pt")
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        names = {n: zf.read(n) for n in zf.namelist()}
    pkl = next(n for n in names if n.endswith("data.pkl"))
    # persistent id -> BUILD with a dict: must be refused rather than overwrite the stand-in's fields
    names[pkl] = (b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
                  b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ}b.")
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in names.items():
            zf.writestr(n, data)
    with pytest.raises(ModelLoadError, match="set state"):
        load_torch(path)


def test_corrupt_and_foreign_files(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_torch(str(tmp_path / "missing.pt"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ModelLoadError, match="junk.pt"):
        load_torch(str(junk))
    notorch = str(tmp_path / "other.zip")
    with zipfile.ZipFile(notorch, "w") as zf:
        zf.writestr("constants.pkl", b"")
    with pytest.raises(ModelLoadError, match="data.pkl"):
        load_torch(notorch)
    tar = str(tmp_path / "old.tar")
    with tarfile.open(tar, "w") as tf:
        info = tarfile.TarInfo("storages")
        tf.addfile(info, io.BytesIO(b""))
    with pytest.raises(ModelLoadError, match="tar"):
        load_torch(tar)


def test_truncated_checkpoints(tmp_path):
    path = str(tmp_path / "t.pt")
    torch.save({"w": torch.ones(64)}, path)
    with zipfile.ZipFile(path) as zf:
        names = {n: zf.read(n) for n in zf.namelist()}
    data = next(n for n in names if "/data/" in n)
    names[data] = names[data][:100]
    with zipfile.ZipFile(path, "w") as zf:
        for n, blob in names.items():
            zf.writestr(n, blob)
    with pytest.raises(ModelLoadError, match=r"t\.pt.*has 100 bytes, needs 256"):
        load_torch(path)
    legacy = str(tmp_path / "l.pt")
    torch.save({"w": torch.ones(64)}, legacy, _use_new_zipfile_serialization=False)
    with open(legacy, "rb") as f:
        blob = f.read()
    with open(legacy, "wb") as f:
        f.write(blob[:-10])
    with pytest.raises(ModelLoadError, match=r"l\.pt.*truncated"):
        load_torch(legacy)


def test_out_of_bounds_view_is_rejected(tmp_path):
    path = str(tmp_path / "oob.pt")
    # a hand-made v2 rebuild whose size overruns its 4-element storage
    pkl = (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
           b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQK\x00K\x08\x85K\x01\x85\x89"
           b"ccollections\nOrderedDict\n)RtRs.")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/data/0", np.ones(4, np.float32).tobytes())
    with pytest.raises(ModelLoadError, match=r"tensor 'w'.*reads past its storage"):
        load_torch(path)
