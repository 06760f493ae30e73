"""Torch checkpoints cannot make the reader allocate more than the file holds (issue #24 repro 11)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cortexstream.errors import ModelLoadError
from cortexstream.port import load_checkpoint

torch = pytest.importorskip("torch")


def test_broadcast_view_larger_than_its_storage_is_refused(tmp_path):
    path = str(tmp_path / "expand.pth")
    torch.save({"w": torch.zeros(1).expand(100000, 100000)}, path)  # storage of 1 float, stride (0, 0)
    assert os.path.getsize(path) < 4096
    with pytest.raises(ModelLoadError, match=r"'w' .*stride \(0, 0\).* has 10000000000 elements .* but its storage"):
        load_checkpoint(path)


def test_ordinary_views_and_shared_storages_still_load(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = str(tmp_path / "views.pth")
    torch.save({"t": base.t(), "row": base[1], "same": base}, path)
    tensors = load_checkpoint(path).tensors
    assert np.array_equal(np.array(tensors["t"]), base.t().numpy())
    assert np.array_equal(np.array(tensors["row"]), base[1].numpy())


def test_compressed_zip_records_are_refused(tmp_path):
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "deflated.pth"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info))
    with pytest.raises(ModelLoadError, match="deflated.pth: record '.*' is compressed"):
        load_checkpoint(str(path))


def test_legacy_storage_claiming_more_than_the_file_holds_is_refused(tmp_path):
    import struct

    values = torch.tensor([1.5, 2.5, 3.5, 4.5])
    path = tmp_path / "legacy.pt"
    torch.save({"w": values}, str(path), _use_new_zipfile_serialization=False)
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<q", 4) + values.numpy().tobytes())
    data[at:at + 8] = struct.pack("<q", 2**60)
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"legacy.pt: storage '.*' claims 1152921504606846976 elements"):
        load_checkpoint(str(path))
