"""A GGUF with K-quant tensors is read by gguf-py, never by `mx.load`, whose Q4_K decoding differs from the
reference (models/gguf_reader.py)."""

from __future__ import annotations

import numpy as np


def _write(path: str, rng: np.random.Generator) -> np.ndarray:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    blocks = 4
    raw = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    # Each 144-byte Q4_K block starts with two float16 scales (d, dmin): keep them finite and small.
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.002] * blocks, dtype=np.float16).tobytes(),
                                dtype=np.uint8).reshape(blocks, 4)
    writer.add_tensor("blk.0.attn_q.weight", raw.reshape(1, -1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.add_tensor("token_embd.weight", rng.standard_normal((4, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q4_K).reshape(1, blocks * 256)


def test_k_quant_files_are_dequantized_by_the_reference_reader(tmp_path):
    from cortexstream.models.gguf_reader import read_gguf

    path = str(tmp_path / "kquant.gguf")
    expected = _write(path, np.random.default_rng(0))
    tensors, _, reader = read_gguf(path)
    assert reader == "gguf-py"
    got = np.array(tensors["blk.0.attn_q.weight"]).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
