"""Pure mappings from GGUF names and metadata onto mlx-lm's model classes (no I/O, no MLX ops).

llama.cpp's converter permutes the Q and K projections of llama-architecture models so that RoPE rotates
interleaved pairs; mlx-lm's `rope_traditional=True` is exactly that rotation, so the weights are used as stored.
qwen2 GGUFs are not permuted and use the default (half-split) RoPE.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from cortexstream.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
ROPE_TRADITIONAL = {"llama": True, "qwen2": False}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias|scales|biases)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias|scales|biases)$")


def map_gguf_tensor_names(tensors: Mapping[str, Any], source: str = "<gguf>") -> dict[str, Any]:
    """Rename GGUF tensors to mlx-lm parameter paths. Unknown tensors are an error, not silently dropped."""
    mapped: dict[str, Any] = {}
    for name, value in tensors.items():
        block = _BLOCK_RE.match(name)
        if block:
            layer, part, suffix = block.groups()
            if part not in _BLOCK_NAMES:
                raise UnsupportedModelError(f"{source}: unsupported tensor '{name}' (unknown block part '{part}')")
            mapped[f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"] = value
            continue
        top = _GLOBAL_RE.match(name)
        if top and top.group(1) in _GLOBAL_NAMES:
            mapped[f"{_GLOBAL_NAMES[top.group(1)]}.{top.group(2)}"] = value
            continue
        if name == "rope_freqs.weight":
            raise UnsupportedModelError(
                f"{source}: tensor 'rope_freqs.weight' (Llama-3.1-style RoPE frequency scaling) is not supported yet"
            )
        raise UnsupportedModelError(f"{source}: unsupported tensor '{name}'")
    return mapped


def _scalar(metadata: Mapping[str, Any], key: str, source: str, default: Any = None) -> Any:
    if key not in metadata:
        if default is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks required key '{key}'")
        return default
    value = metadata[key]
    return value.item() if hasattr(value, "item") else value


def gguf_model_config(metadata: Mapping[str, Any], tensor_names: set[str], source: str = "<gguf>") -> dict[str, Any]:
    """Build an mlx-lm `config.json`-style dict from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{source}: GGUF metadata lacks 'general.architecture'")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden = int(_scalar(metadata, f"{arch}.embedding_length", source))
    heads = int(_scalar(metadata, f"{arch}.attention.head_count", source))
    kv_heads = int(_scalar(metadata, f"{arch}.attention.head_count_kv", source, heads))
    # head_dim is its own hyper-parameter (key_length); hidden/heads is only the fallback.
    head_dim = int(_scalar(metadata, f"{arch}.attention.key_length", source, hidden // heads))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(_scalar(metadata, f"{arch}.vocab_size", source, len(tokens) if tokens else -1))
    if vocab <= 0:
        raise ModelLoadError(f"{source}: cannot determine vocab size (no '{arch}.vocab_size' nor token list)")
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(metadata, f"{arch}.block_count", source)),
        "intermediate_size": int(_scalar(metadata, f"{arch}.feed_forward_length", source)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": float(_scalar(metadata, f"{arch}.attention.layer_norm_rms_epsilon", source, 1e-6)),
        "vocab_size": vocab,
        "rope_theta": float(_scalar(metadata, f"{arch}.rope.freq_base", source, 10000.0)),
        "rope_traditional": ROPE_TRADITIONAL[arch],
        "max_position_embeddings": int(_scalar(metadata, f"{arch}.context_length", source, 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if arch == "llama":
        config["head_dim"] = head_dim
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    elif head_dim != hidden // heads:
        raise UnsupportedModelError(f"{source}: qwen2 with head_dim {head_dim} != hidden/heads is not supported")
    return config


def quantization_of(weights: Mapping[str, Any], group_size: int = 32) -> dict[str, dict[str, int]]:
    """Per-module MLX quantisation parameters of already-renamed weights ({module path: {group_size, bits}})."""
    params: dict[str, dict[str, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed = weights[f"{module}.weight"]
        # uint32 words hold 32/bits values; scales hold one value per group.
        bits = (packed.shape[-1] * 32) // (scales.shape[-1] * group_size)
        params[module] = {"group_size": group_size, "bits": int(bits)}
    return params
