"""GGUF loading on tiny random-weight models: mapping, config, quantisations, strictness and errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import cortexstream
from cortexstream.errors import ModelLoadError, UnsupportedModelError
from cortexstream.models.gguf_mapping import gguf_model_config, map_gguf_tensor_names
from cortexstream.models.loader import model_info
from tiny_models import TINY_CONFIG, model_with_weights, tiny_model, write_tiny_gguf

TOKENS = mx.array([[5, 40, 77, 120, 3, 200, 9, 31]])


def _logits(model):
    return np.array(model(TOKENS))


@pytest.mark.parametrize("quant, tol", [("F32", 1e-5), ("F16", 1e-5), ("Q8_0", 1e-4), ("Q4_0", 1e-4), ("Q4_1", 1e-4)])
def test_gguf_roundtrip_matches_source_model(tmp_path, quant, tol):
    source = tiny_model(seed=1)
    path = str(tmp_path / f"tiny-{quant}.gguf")
    stored = write_tiny_gguf(path, source, quant=quant)
    reference = model_with_weights(stored)  # same weights as the file holds, computed by plain mlx-lm
    loaded, tokenizer = cortexstream.load(path)
    np.testing.assert_allclose(_logits(loaded), _logits(reference), atol=tol, rtol=tol)
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32  # dequantised on CPU
    info = model_info(loaded)
    assert info.architecture == "llama" and info.num_kv_heads == 2 and info.head_dim == 16
    assert tokenizer.encode("the") and tokenizer.decode(tokenizer.encode("hello there")) == "hello there"


def test_k_quant_style_fallback_dequantises_with_gguf_package(tmp_path):
    # Q5_0 is not readable by mx.load; the gguf package path must take over transparently.
    source = tiny_model(seed=2)
    path = str(tmp_path / "tiny-q5.gguf")
    stored = write_tiny_gguf(path, source, quant="Q5_0")
    loaded, _ = cortexstream.load(path)
    np.testing.assert_allclose(_logits(loaded), _logits(model_with_weights(stored)), atol=1e-4, rtol=1e-4)
    assert "gguf-py" in model_info(loaded).format


def test_keep_quantized_option_keeps_mlx_quantized_layers(tmp_path):
    import mlx.nn as nn

    path = str(tmp_path / "tiny-q8.gguf")
    stored = write_tiny_gguf(path, tiny_model(seed=3), quant="Q8_0")
    loaded, _ = cortexstream.load(path, dequantize=False)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    np.testing.assert_allclose(_logits(loaded), _logits(model_with_weights(stored)), atol=2e-3, rtol=2e-3)


def test_qwen2_gguf_uses_biases_and_default_rope(tmp_path):
    config = {**TINY_CONFIG, "model_type": "qwen2", "rope_traditional": False}
    config.pop("head_dim")
    source = tiny_model(seed=4, model_type="qwen2", rope_traditional=False, head_dim=None)
    path = str(tmp_path / "tiny-qwen2.gguf")
    stored = write_tiny_gguf(path, source, config=config)
    assert any(k.endswith("q_proj.bias") for k in stored)
    loaded, _ = cortexstream.load(path)
    reference = model_with_weights(stored, model_type="qwen2", rope_traditional=False, head_dim=None)
    np.testing.assert_allclose(_logits(loaded), _logits(reference), atol=1e-5, rtol=1e-5)
    assert loaded.args.rope_traditional is False


def test_head_dim_comes_from_metadata_not_hidden_over_heads():
    meta = {
        "general.architecture": "llama", "llama.embedding_length": mx.array(64),
        "llama.attention.head_count": mx.array(4), "llama.attention.head_count_kv": mx.array(2),
        "llama.attention.key_length": mx.array(32), "llama.block_count": mx.array(1),
        "llama.feed_forward_length": mx.array(8), "llama.vocab_size": mx.array(10),
    }
    config = gguf_model_config(meta, {"token_embd.weight"})
    assert config["head_dim"] == 32 and config["rope_traditional"] is True and config["tie_word_embeddings"]


def test_mapping_is_pure_and_rejects_unknown_tensors():
    mapped = map_gguf_tensor_names({"blk.3.attn_q.weight": 1, "blk.3.ffn_down.scales": 2, "output_norm.weight": 3})
    assert mapped == {
        "model.layers.3.self_attn.q_proj.weight": 1,
        "model.layers.3.mlp.down_proj.scales": 2,
        "model.norm.weight": 3,
    }
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_weird.weight"):
        map_gguf_tensor_names({"blk.0.attn_weird.weight": 0}, "x.gguf")


def test_unsupported_architecture_names_it(tmp_path):
    path = str(tmp_path / "phi.gguf")
    write_tiny_gguf(path, tiny_model(), config={**TINY_CONFIG, "model_type": "phi3"})
    with pytest.raises(UnsupportedModelError, match="architecture 'phi3' is not supported"):
        cortexstream.load(path)


def test_missing_truncated_and_non_gguf_files(tmp_path):
    with pytest.raises(ModelLoadError, match="file not found"):
        cortexstream.load(str(tmp_path / "nope.gguf"))
    path = str(tmp_path / "t.gguf")
    write_tiny_gguf(path, tiny_model())
    data = open(path, "rb").read()
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="trunc.gguf"):
        cortexstream.load(str(truncated))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        cortexstream.load(str(bogus))


def test_gguf_without_tokenizer_metadata_is_a_clear_error(tmp_path):
    path = str(tmp_path / "notok.gguf")
    write_tiny_gguf(path, tiny_model(), tokenizer=False)
    with pytest.raises(ModelLoadError, match="notok.gguf.*tokenizer"):
        cortexstream.load(path)


def test_missing_weight_is_a_strict_loading_error(tmp_path):
    import mlx.nn as nn

    model = tiny_model()
    model.model.layers[1].mlp.up_proj = nn.Identity()  # its weight will be absent from the file
    path = str(tmp_path / "missing.gguf")
    write_tiny_gguf(path, model)
    with pytest.raises(ModelLoadError, match="missing.gguf.*up_proj"):
        cortexstream.load(path)


def test_hub_repo_offline_is_a_clear_error_not_a_hang(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match="someone/some-model.*offline"):
        cortexstream.load("someone/some-model")
    with pytest.raises(ModelLoadError, match="not a hub repo id"):
        cortexstream.load(str(tmp_path / "no" / "such" / "dir"))


def _save_mlx_lm_directory(path, model, tokenizer, quantize=False):
    import json

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    path.mkdir()
    config = dict(TINY_CONFIG)
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
        config["quantization"] = {"group_size": 32, "bits": 8}
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    tokenizer._tokenizer.save_pretrained(str(path))


def test_local_mlx_lm_directory_loads_with_its_tokenizer(tmp_path, tiny):
    _, gguf_tokenizer = tiny
    source = tiny_model(seed=9)
    expected = _logits(source)
    _save_mlx_lm_directory(tmp_path / "plain", source, gguf_tokenizer)
    loaded, tokenizer = cortexstream.load(str(tmp_path / "plain"))
    np.testing.assert_allclose(_logits(loaded), expected, atol=1e-5)
    assert tokenizer.encode("hello there") == gguf_tokenizer.encode("hello there")
    assert model_info(loaded).format.startswith("mlx-lm directory")


def test_quantized_directory_is_dequantised_on_cpu(tmp_path, tiny):
    import mlx.nn as nn

    _, gguf_tokenizer = tiny
    source = tiny_model(seed=10)
    _save_mlx_lm_directory(tmp_path / "q8", source, gguf_tokenizer, quantize=True)
    quantized_logits = _logits(source)  # `source` is quantised in place by the helper
    loaded, _ = cortexstream.load(str(tmp_path / "q8"))
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, nn.Linear)
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    np.testing.assert_allclose(_logits(loaded), quantized_logits, atol=2e-3)
    kept, _ = cortexstream.load(str(tmp_path / "q8"), dequantize=False)
    assert isinstance(kept.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_directory_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        cortexstream.load(str(tmp_path / "empty"))
