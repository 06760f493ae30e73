"""KVCompressor semantics without torch: grouping order, remainder, min_seq_len, image prefix, errors."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.compression import CompressorConfig, KVCompressor, head_dim_of, segment_length
from cortexstream.errors import InvalidArgumentError, ModelLoadError

D, F = 4, 3


def _first_token_selector(config: CompressorConfig) -> KVCompressor:
    """Weights making each MLP return the first token of its group (exact for positive inputs): this exposes
    the grouping order and what is merged vs kept."""
    comp = KVCompressor(config)
    pick = np.zeros((config.head_dim, config.head_dim * config.factor), np.float32)
    pick[:, : config.head_dim] = np.eye(config.head_dim)
    state = {}
    for key in comp.state_dict():
        slot = int(key.split(".")[2])
        if key.endswith("bias"):
            state[key] = mx.zeros((config.head_dim,))
        else:
            state[key] = mx.array(pick) if slot == 0 else mx.eye(config.head_dim)
    # scale image MLPs by 2 so the two paths are distinguishable
    state = {k: v * 2 if k.startswith("compress_i") and k.endswith(".6.weight") else v for k, v in state.items()}
    return KVCompressor.from_state_dict(state, min_seq_len=config.min_seq_len)


def _tokens(seq: int, heads: int = 2, batch: int | None = 1) -> mx.array:
    # token t of head h holds values 1 + 100*h + t (positive, so ReLU is the identity on them)
    x = 1.0 + np.arange(seq)[None, :, None] + 100.0 * np.arange(heads)[:, None, None] + np.zeros((1, 1, D))
    x = x.astype(np.float32)
    return mx.array(x if batch is None else np.broadcast_to(x, (batch, *x.shape)).copy())


def test_groups_consecutive_tokens_and_keeps_remainder():
    comp = _first_token_selector(CompressorConfig(num_layers=2, head_dim=D, factor=F))
    k = _tokens(11)
    out_k, out_v = comp.compress(k, k * 1, layer=1)
    assert out_k.shape == (1, 2, 3 + 2, D) == out_v.shape  # 11 = 3 groups of 3 + 2 remainder tokens
    np.testing.assert_array_equal(np.array(out_k)[0, 1, :, 0], [101, 104, 107, 110, 111])
    assert comp.output_length(11) == 5 == segment_length(11, F, 1)


def test_min_seq_len_and_short_sequences():
    comp = _first_token_selector(CompressorConfig(num_layers=1, head_dim=D, factor=F, min_seq_len=2))
    for seq, want in ((2, 2), (5, 5), (6, 2), (8, 4)):
        out, _ = comp.compress(_tokens(seq, batch=None), _tokens(seq, batch=None), 0)  # [H, S, D] input
        assert out.shape == (2, want, D) and comp.output_length(seq) == want
    zero = KVCompressor(CompressorConfig(num_layers=1, head_dim=D, factor=F, min_seq_len=0))
    assert zero.compress(_tokens(2), _tokens(2), 0)[0].shape[2] == 2  # no full group: unchanged


def test_image_prefix_uses_image_mlps_and_text_only_keeps_it():
    comp = _first_token_selector(CompressorConfig(num_layers=1, head_dim=D, factor=F))
    k = _tokens(10)
    out, _ = comp.compress(k, k, 0, image_len=4)  # image: 1 group + 1 kept; text (6): 2 groups
    np.testing.assert_array_equal(np.array(out)[0, 0, :, 0], [2 * 1, 4, 5, 8])
    assert comp.output_length(10, image_len=4) == 4
    assert comp.compress(k, k, 0, image_len=99)[0].shape[2] == comp.output_length(10, 99) == 4  # all image, clamped
    text_only = _first_token_selector(CompressorConfig(num_layers=1, head_dim=D, factor=F, image=False))
    out, _ = text_only.compress(k, k, 0, image_len=4)
    np.testing.assert_array_equal(np.array(out)[0, 0, :, 0], [1, 2, 3, 4, 5, 8])
    assert text_only.output_length(10, image_len=4) == 6


def test_dtype_is_preserved_and_all_layer_call():
    comp = KVCompressor(CompressorConfig(num_layers=2, head_dim=D, factor=2))
    kv = [(_tokens(7).astype(mx.float16), _tokens(7).astype(mx.float16)) for _ in range(2)]
    out = comp(kv)
    assert len(out) == 2 and all(k.dtype == mx.float16 and k.shape == (1, 2, 4, D) for k, _ in out)
    with pytest.raises(InvalidArgumentError, match="3 layers"):
        comp(kv + kv[:1])


def test_dropout_only_in_training():
    comp = KVCompressor(CompressorConfig(num_layers=1, head_dim=D, factor=2, dropout=0.5))
    k = _tokens(8)
    a, b = comp.compress(k, k, 0)[0], comp.compress(k, k, 0)[0]
    np.testing.assert_array_equal(np.array(a), np.array(b))
    assert not comp.training
    comp.train()
    assert comp.compress_tk[0][2].training


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(num_layers=0, head_dim=4, factor=2), "num_layers"),
    (dict(num_layers=1, head_dim=4, factor=1), "factor: must be >= 2"),
    (dict(num_layers=1, head_dim=4, factor=2, min_seq_len=-1), "min_seq_len"),
    (dict(num_layers=1, head_dim=4, factor=2, dropout=1.0), "dropout"),
])
def test_config_validation(kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        CompressorConfig(**kwargs)


def test_compress_argument_errors():
    comp = KVCompressor(CompressorConfig(num_layers=1, head_dim=D, factor=2))
    k = _tokens(6)
    with pytest.raises(InvalidArgumentError, match=r"\[B, H, S, 4\]"):
        comp.compress(mx.zeros((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)), 0)
    with pytest.raises(InvalidArgumentError, match="equal shapes"):
        comp.compress(k, k[:, :, :5], 0)
    with pytest.raises(InvalidArgumentError, match="layer: 1 is out of range"):
        comp.compress(k, k, 1)
    with pytest.raises(InvalidArgumentError, match="image_len"):
        comp.compress(k, k, 0, image_len=-1)


def test_from_state_dict_infers_config_and_is_strict():
    src = KVCompressor(CompressorConfig(num_layers=3, head_dim=D, factor=4, image=False))
    state = {f"module.compressor.{k}": v for k, v in src.state_dict().items()}  # wrapper prefixes are stripped
    state["module.compressor.attention.0.weight"] = mx.zeros((1, D))  # the reference's unused head: dropped
    again = KVCompressor.from_state_dict(state, min_seq_len=2)
    assert again.config == CompressorConfig(num_layers=3, head_dim=D, factor=4, min_seq_len=2, image=False)
    broken = dict(src.state_dict())
    del broken["compress_tv.2.3.bias"]
    with pytest.raises(ModelLoadError, match="x.pth: weights do not match .*missing keys 'compress_tv.2.3.bias'"):
        KVCompressor.from_state_dict(broken, source="x.pth")
    with pytest.raises(ModelLoadError, match="not a FastCache-style KV compressor"):
        KVCompressor.from_state_dict({"foo": mx.zeros(1)})
    with pytest.raises(ModelLoadError, match="factor 3 does not match"):
        KVCompressor.from_state_dict(src.state_dict(), factor=3)


def test_head_dim_of_uses_the_real_head_dim():
    gqa = SimpleNamespace(args=SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3))
    assert head_dim_of(gqa) == 64  # not 576 // 3 = 192 as the reference computes
    assert head_dim_of(SimpleNamespace(args=SimpleNamespace(head_dim=128, hidden_size=576))) == 128
    assert head_dim_of(SimpleNamespace(cortexstream_info=SimpleNamespace(head_dim=32))) == 32
    with pytest.raises(InvalidArgumentError):
        head_dim_of(object())
