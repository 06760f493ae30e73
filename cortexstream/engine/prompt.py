"""Prompts to token ids: a string, token ids or chat messages (through the tokenizer's chat template).

Part of the engine (`Engine.add_request` takes any of the three forms), below the public calls that also use it.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import mlx.core as mx

from cortexstream.engine.text_input import repair_messages, repair_text
from cortexstream.errors import InvalidArgumentError


def prompt_to_tokens(tokenizer: Any, prompt: Any) -> list[int]:
    """Accept a string, a list of token ids, or chat messages (the chat template is applied)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("prompt: empty string")
        return list(tokenizer.encode(repair_text(prompt)))  # undecodable bytes -> U+FFFD, not a TypeError
    if isinstance(prompt, (bytes, bytearray)):
        raise InvalidArgumentError("prompt: got bytes; pass text (decode it first) or a list of token ids")
    if isinstance(prompt, mx.array):
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        for i, message in enumerate(prompt):
            if "role" not in message or "content" not in message:
                raise InvalidArgumentError(f"prompt: chat message {i} needs 'role' and 'content' keys")
        return chat_tokens(tokenizer, prompt)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        limit = _vocab_size(tokenizer)
        bad = [t for t in prompt if t < 0 or t >= limit]
        if bad:
            raise InvalidArgumentError(f"prompt: token ids out of range for the vocabulary: {bad[:5]}")
        return list(prompt)
    raise InvalidArgumentError(
        "prompt: expected a non-empty string, a list of token ids, or a list of {'role','content'} messages"
    )


def chat_tokens(tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None = None,
                continue_final_message: bool = False) -> list[int]:
    """Chat messages through the tokenizer's template: with a generation prompt, or continuing the last (assistant)
    message; `tools` goes to the template's own `tools` argument."""
    kwargs: dict[str, Any] = {"tokenize": True}
    if continue_final_message:
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    else:
        kwargs["add_generation_prompt"] = True
    if tools:
        kwargs["tools"] = tools
    tokens = tokenizer.apply_chat_template(repair_messages(list(messages)), **kwargs)
    return list(tokens["input_ids"] if isinstance(tokens, dict) else tokens)


def _vocab_size(tokenizer: Any) -> int:
    """len(get_vocab()), remembered per tokenizer: get_vocab() builds a dict of the whole vocabulary, which a
    server would otherwise pay on the engine thread per request. A memo only (weak keys): it changes no result."""
    try:
        size = _VOCAB_SIZES.get(tokenizer)
    except TypeError:  # not weak-referenceable: no memo
        return len(tokenizer.get_vocab())
    if size is None:
        size = _VOCAB_SIZES[tokenizer] = len(tokenizer.get_vocab())
    return size


_VOCAB_SIZES: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
