"""Parity with PyTorch: a module with the reference's structure and names (Fastcache
`KVCacheLinearDecoupleCompressor`), saved with torch.save, ported torch-free, must match to 1e-5."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.compression import KVCompressor, segment_length
from cortexstream.port import load_checkpoint, load_torch

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = pytest.mark.torch_ref

# SmolLM2-135M-like GQA: hidden 576, 9 query heads, 3 KV heads -> real head_dim 64 (the reference would use 192).
HIDDEN, HEADS, KV_HEADS = 576, 9, 3
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2


def _block(d: int, f: int) -> "nn.Sequential":
    return nn.Sequential(nn.Linear(d * f, d), nn.ReLU(), nn.Dropout(p=0.4), nn.Linear(d, d), nn.ReLU(),
                         nn.Dropout(p=0.4), nn.Linear(d, d))


class TorchReference(nn.Module):
    """Independent re-statement of the reference: same module names, grouping, remainder and it_len semantics."""

    def __init__(self, layers: int, head_dim: int, factor: int, min_seq_len: int = 1) -> None:
        super().__init__()
        self.head_dim, self.compression_factor, self.min_seq_len = head_dim, factor, min_seq_len
        for name in ("compress_tk", "compress_tv", "compress_ik", "compress_iv"):
            setattr(self, name, nn.ModuleList([_block(head_dim, factor) for _ in range(layers)]))
        self.attention = nn.ModuleList([nn.Linear(head_dim, 1) for _ in range(layers)])  # unused, as upstream

    def compress_layer(self, k, v, layer, ck, cv):
        b, h, s, _ = k.shape
        n = s // self.compression_factor
        if n < self.min_seq_len:
            return k, v
        m = n * self.compression_factor
        outk = ck[layer](k[:, :, :m].reshape(b, h, n, self.head_dim * self.compression_factor))
        outv = cv[layer](v[:, :, :m].reshape(b, h, n, self.head_dim * self.compression_factor))
        if s > m:
            outk, outv = torch.cat([outk, k[:, :, m:]], dim=2), torch.cat([outv, v[:, :, m:]], dim=2)
        return outk, outv

    def forward(self, kv_cache, it_len):
        out = []
        n = it_len[0]
        for i, (k, v) in enumerate(kv_cache):
            ik, iv = self.compress_layer(k[:, :, :n], v[:, :, :n], i, self.compress_ik, self.compress_iv)
            tk, tv = self.compress_layer(k[:, :, n:], v[:, :, n:], i, self.compress_tk, self.compress_tv)
            out.append((torch.cat([ik, tk], dim=2), torch.cat([iv, tv], dim=2)))
        return out


def _ported(tmp_path, factor: int, min_seq_len: int, *, nest: bool = False, legacy: bool = False):
    torch.manual_seed(factor * 10 + min_seq_len)
    ref = TorchReference(LAYERS, HEAD_DIM, factor, min_seq_len).eval()
    path = str(tmp_path / f"compressor_f{factor}.pth")
    sd = ref.state_dict()
    obj = {"model_state_dict": {"compressor": sd}, "epoch": 7} if nest else sd
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return ref, KVCompressor.from_file(path, min_seq_len=min_seq_len), path


def _compare(ref, ours, seq_len: int, image_len: int, batch: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(batch, KV_HEADS, seq_len, HEAD_DIM, generator=g),
           torch.randn(batch, KV_HEADS, seq_len, HEAD_DIM, generator=g)) for _ in range(LAYERS)]
    with torch.no_grad():
        want = ref(kv, [image_len, seq_len - image_len])
    got = ours([(mx.array(k.numpy()), mx.array(v.numpy())) for k, v in kv], image_len=image_len)
    for (wk, wv), (gk, gv) in zip(want, got, strict=True):
        assert tuple(gk.shape) == tuple(wk.shape) and tuple(gv.shape) == tuple(wv.shape)
        assert gk.shape[2] == ours.output_length(seq_len, image_len)
        np.testing.assert_allclose(np.array(gk), wk.numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.array(gv), wv.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [16, 19, 3])  # exact multiple, remainder of 3, shorter than factor
def test_text_path_matches_torch(tmp_path, seq_len):
    ref, ours, _ = _ported(tmp_path, factor=4, min_seq_len=1)
    assert ours.config.head_dim == HEAD_DIM and ours.config.factor == 4 and ours.config.num_layers == LAYERS
    _compare(ref, ours, seq_len, image_len=0)


def test_min_seq_len_keeps_short_segments(tmp_path):
    ref, ours, _ = _ported(tmp_path, factor=4, min_seq_len=3)
    _compare(ref, ours, 11, image_len=0)  # 11 // 4 = 2 < 3: unchanged
    _compare(ref, ours, 13, image_len=0, seed=1)  # 3 merged + 1 remainder
    assert segment_length(11, 4, 3) == 11 and segment_length(13, 4, 3) == 4


@pytest.mark.parametrize("image_len", [8, 10, 30])  # aligned, ragged, longer than the sequence (clamped)
def test_image_prefix_uses_image_mlps(tmp_path, image_len):
    ref, ours, _ = _ported(tmp_path, factor=4, min_seq_len=1, nest=True)
    _compare(ref, ours, 23, image_len=min(image_len, 23))
    if image_len > 23:  # ours clamps like InfiniLM; the reference slices, which clamps too
        k = mx.zeros((KV_HEADS, 23, HEAD_DIM))
        assert ours.compress(k, k, 0, image_len=image_len)[0].shape[1] == ours.output_length(23, image_len)


def test_legacy_checkpoint_and_unbatched_input(tmp_path):
    ref, ours, path = _ported(tmp_path, factor=3, min_seq_len=1, legacy=True)
    assert load_checkpoint(path).format == "torch-legacy"
    k = torch.randn(1, KV_HEADS, 10, HEAD_DIM)
    with torch.no_grad():
        (want, _), = ref([(k, k)], [0, 10])[:1]
    got, _ = ours.compress(mx.array(k[0].numpy()), mx.array(k[0].numpy()), 0)  # [H, S, D]
    np.testing.assert_allclose(np.array(got), want[0].numpy(), atol=1e-5, rtol=1e-5)


def test_ported_names_and_attention_drop(tmp_path):
    ref, ours, path = _ported(tmp_path, factor=4, min_seq_len=1)
    raw = load_torch(path)
    assert "attention.0.weight" in raw and "compress_iv.1.6.bias" in raw
    assert raw["compress_tk.0.0.weight"].shape == (HEAD_DIM, HEAD_DIM * 4)
    mine = ours.state_dict()
    assert set(mine) == {k for k in raw if not k.startswith("attention.")}
    for key, value in mine.items():
        np.testing.assert_array_equal(np.array(value), ref.state_dict()[key].numpy())


def test_safetensors_and_bin_exports_roundtrip(tmp_path):
    ref, ours, _ = _ported(tmp_path, factor=4, min_seq_len=2)
    st, fp32, fp16 = (os.path.join(tmp_path, n) for n in ("c.safetensors", "c32.bin", "c16.bin"))
    ours.save(st)
    ours.save_infinilm_bin(fp32, dtype="float32")
    ours.save_infinilm_bin(fp16, dtype="float16")
    for path in (st, fp32):
        again = KVCompressor.from_file(path)
        assert again.config == ours.config  # min_seq_len comes back from metadata / header
        _compare(ref, again, 21, image_len=5)
    half = KVCompressor.from_file(fp16)
    k = mx.array(np.random.default_rng(0).standard_normal((1, KV_HEADS, 20, HEAD_DIM)).astype(np.float32))
    a, _ = ours.compress(k, k, 1)
    b, _ = half.compress(k, k, 1)
    assert b.dtype == mx.float32
    np.testing.assert_allclose(np.array(b), np.array(a), atol=2e-2)
