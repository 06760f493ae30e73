"""Builds the committed corpus of handcrafted GGUF files (tests/data/gguf_corpus/): one file per class of bad
file that llama.cpp's tests/test-gguf.cpp defines, plus the classes it expects to load.

Regenerate with `python tests/gguf_corpus.py` (deterministic). Each file is named `<CLASS>.gguf`; the `ok_`
classes must pass the header check, every other class must be refused with a ModelLoadError. The generator is
our own code; only the list of classes comes from llama.cpp.
"""

from __future__ import annotations

import os
import random
import struct
import sys

CORPUS_DIR = os.path.join(os.path.dirname(__file__), "data", "gguf_corpus")

BAD_CLASSES = (
    "HEADER_BAD_MAGIC", "HEADER_BAD_VERSION_0", "HEADER_BAD_VERSION_1", "HEADER_BAD_VERSION_FUTURE",
    "HEADER_BAD_N_TENSORS", "HEADER_BAD_N_KV",
    "KV_BAD_KEY_SIZE", "KV_EMPTY_KEY", "KV_BAD_TYPE", "KV_DUPLICATE_KEY", "KV_BAD_ALIGN", "KV_WRONG_TYPE_ALIGN",
    "TENSORS_BAD_NAME_SIZE", "TENSORS_BAD_N_DIMS", "TENSORS_BAD_SHAPE", "TENSORS_NE_TOO_BIG",
    "TENSORS_NBYTES_TOO_BIG", "TENSORS_BAD_TYPE", "TENSORS_BAD_OFFSET", "TENSORS_DUPLICATE_NAME",
    "TENSORS_BAD_ALIGN", "TENSORS_INCONSISTENT_ALIGN",
    "DATA_NOT_ENOUGH_DATA", "DATA_BAD_ALIGN", "DATA_INCONSISTENT_ALIGN", "DATA_MEM_SIZE_OVERFLOW",
)
GOOD_CLASSES = ("ok_HEADER_EMPTY", "ok_KV_SUCCESS", "ok_TENSORS_ZERO_DIM", "ok_DATA_SUCCESS", "ok_DATA_CUSTOM_ALIGN")
# Valid headers without their tensor data: llama.cpp's test accepts them because it parses the header only
# (no_alloc); we are about to hand the file to mx.load, which would read the data, so they must be refused.
HEADER_ONLY_CLASSES = ("header_only_TENSORS_SUCCESS", "header_only_TENSORS_CUSTOM_ALIGN")
# (ggml type, elements per block, bytes per block): F32, F16, Q4_0, Q8_0, I8, I32, I64.
_TYPES = ((0, 1, 4), (1, 1, 2), (2, 32, 18), (8, 32, 34), (24, 1, 1), (26, 1, 4), (27, 1, 8))
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _kv(rng: random.Random, key: bytes, bad_type: bool) -> bytes:
    kind = 13 if bad_type else rng.choice([*_SCALARS, 8, 9])
    out = _string(key) + struct.pack("<i", kind)
    if bad_type:
        return out + b"\x01"
    if kind in _SCALARS:
        return out + struct.pack("<" + _SCALARS[kind], 1)
    if kind == 8:
        return out + _string(b"v" * rng.randrange(20))
    item = rng.choice(list(_SCALARS))
    count = rng.randrange(8)
    return out + struct.pack("<iQ", item, count) + b"\x00" * (count * struct.calcsize(_SCALARS[item]))


def build(kind: str, seed: int = 0) -> bytes:
    """One handcrafted file of class `kind` (see BAD_CLASSES / GOOD_CLASSES)."""
    name = kind.removeprefix("ok_").removeprefix("header_only_")
    rng = random.Random(seed)
    section = name.split("_")[0]
    has_kv, has_tensors, has_data = section in ("KV", "TENSORS", "DATA"), section in ("TENSORS", "DATA"), section == "DATA"
    custom_align = name in ("KV_BAD_ALIGN", "KV_WRONG_TYPE_ALIGN", "TENSORS_BAD_ALIGN", "TENSORS_CUSTOM_ALIGN",
                            "DATA_BAD_ALIGN", "DATA_CUSTOM_ALIGN")
    alignment = 32
    version = {"HEADER_BAD_VERSION_0": 0, "HEADER_BAD_VERSION_1": 1, "HEADER_BAD_VERSION_FUTURE": 4}.get(name, 3)
    magic = b"FUGG" if name == "HEADER_BAD_MAGIC" else b"GGUF"

    tensors = [(rng.choice(_TYPES), [rng.randrange(1, 5) for _ in range(rng.randrange(1, 5))])
               for _ in range(6)] if has_tensors else []
    if name == "DATA_MEM_SIZE_OVERFLOW":
        tensors = [((24, 1, 1), [0x7FFFFFFFFFFFFFC0]), ((24, 1, 1), [0x7FFFFFFFFFFFFFC0])]
    n_kv = 5 if has_kv else 0
    n_tensors = 2**64 - 1 if name == "HEADER_BAD_N_TENSORS" else len(tensors)
    n_kv_field = 2**64 - 1 if name == "HEADER_BAD_N_KV" else n_kv + (1 if custom_align else 0)
    out = bytearray(magic + struct.pack("<IQQ", version, n_tensors, n_kv_field))

    for i in range(n_kv):
        key = b"" if name == "KV_EMPTY_KEY" else b"my_key_%d" % (i // 2 if name == "KV_DUPLICATE_KEY" else i)
        entry = _kv(rng, key, name == "KV_BAD_TYPE")
        if name == "KV_BAD_KEY_SIZE":
            entry = struct.pack("<Q", 2**64 - 1) + entry[8:]
        out += entry
    if custom_align:
        alignment = 13 if "BAD_ALIGN" in name or "WRONG_TYPE" in name else 1
        value_type = 5 if name == "KV_WRONG_TYPE_ALIGN" else 4
        out += _string(b"general.alignment") + struct.pack("<iI", value_type, alignment)
    if not has_tensors:
        out += b"\x00" * (_pad(len(out), alignment) - len(out)) if alignment > 1 else b""
        return bytes(out)

    layout_alignment = 1 if name in ("TENSORS_INCONSISTENT_ALIGN", "DATA_INCONSISTENT_ALIGN") else alignment
    offset = 0
    for i, ((ggml_type, block, block_bytes), dims) in enumerate(tensors):
        tensor_name = b"my_tensor" + (b"" if name == "TENSORS_DUPLICATE_NAME" else b"_%d" % i)
        if name == "TENSORS_BAD_NAME_SIZE":
            tensor_name += b"_with_a_very_long_name_which_is_longer_than_what_ggml_allows_for_tensors"
        shape = [dims[0] * block, *dims[1:]]
        if name == "TENSORS_ZERO_DIM":
            shape = [shape[0], 0]
        if name == "TENSORS_NE_TOO_BIG":
            shape = [4 * (2**31 - 1)] * 2
        if name == "TENSORS_NBYTES_TOO_BIG":
            ggml_type, block, block_bytes = 27, 1, 8
            shape = [2**62 // 8 + 1, 8]
        if name == "TENSORS_BAD_SHAPE":
            shape = [-1] * len(shape)
        n_dims = MAX_DIMS_PLUS_ONE if name == "TENSORS_BAD_N_DIMS" else len(shape)
        out += _string(tensor_name) + struct.pack("<I", n_dims)
        out += struct.pack(f"<{len(shape)}q", *shape)
        out += struct.pack("<i", 9999 if name == "TENSORS_BAD_TYPE" else ggml_type)
        out += struct.pack("<Q", 2**64 - 1 if name == "TENSORS_BAD_OFFSET" else offset % 2**64)
        numel = 1
        for dim in shape:
            numel *= max(dim, 0)
        offset += _pad(numel // block * block_bytes, layout_alignment)
    out += b"\x00" * (_pad(len(out), alignment) - len(out))
    if has_data:
        nbytes = 32 if name == "DATA_MEM_SIZE_OVERFLOW" else offset - (1 if name == "DATA_NOT_ENOUGH_DATA" else 0)
        out += bytes(i % 256 for i in range(nbytes))
    return bytes(out)


MAX_DIMS_PLUS_ONE = 5


def write_corpus(directory: str = CORPUS_DIR) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for kind in BAD_CLASSES + GOOD_CLASSES + HEADER_ONLY_CLASSES:
        path = os.path.join(directory, f"{kind}.gguf")
        with open(path, "wb") as fh:
            fh.write(build(kind))
        paths.append(path)
    return paths


if __name__ == "__main__":
    print("\n".join(write_corpus(sys.argv[1] if len(sys.argv) > 1 else CORPUS_DIR)))
