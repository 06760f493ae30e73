"""Forward-pass helpers over mlx-lm decoders: the output projection, and logits of the last position only."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# mlx-lm model types whose __call__ is exactly `head(self.model(inputs, cache))`.
KNOWN_LAYOUTS = ("llama", "qwen2", "mistral")


def head_of(model: nn.Module) -> Any:
    """The output projection of an mlx-lm decoder (`model.model` -> hidden states -> this -> logits), or None when
    the model is not one of the known layouts (then the whole model is called)."""
    body = getattr(model, "model", None)
    if body is None or getattr(model, "model_type", None) not in KNOWN_LAYOUTS:
        return None
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head
    embed = getattr(body, "embed_tokens", None)
    args = getattr(model, "args", None)
    if embed is not None and getattr(args, "tie_word_embeddings", False):
        return embed.as_linear
    return None


def body_of(model: nn.Module) -> Any:
    """What to call when no logits are needed: the decoder without its output projection (`model.model`) for the
    known layouts, else the whole model."""
    return model.model if head_of(model) is not None else model


def last_token_logits(model: nn.Module, tokens: mx.array, cache: list[Any]) -> mx.array:
    """Logits of the last position only, `[B, 1, V]`: the prompt's other positions never go through the
    vocabulary projection (the largest matmul of a small model's prefill)."""
    head = head_of(model)
    if head is None:
        return model(tokens, cache=cache)[:, -1:, :]
    hidden = model.model(tokens, cache=cache)
    return head(hidden[:, -1:, :])
