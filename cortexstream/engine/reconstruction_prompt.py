"""The token ids that ask a model to repeat its context (KVzip's reconstruction prompt, `policies.kvzip`).

With a chat template: the turn a conversation would take next after an assistant reply, a user message "Repeat the
previous context exactly." and the assistant's header, so that the context, teacher-forced after it, is the
assistant's answer. It is rendered as the difference between a conversation with and without that turn, so no
beginning-of-sequence token or default system prompt is repeated. Without a chat template (or one that does not
extend a conversation by appending to it): the plain text "Repeat the previous context:\n".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError

REQUEST = "Repeat the previous context exactly."
PLAIN_PREFIX = "Repeat the previous context:\n"


@dataclass(frozen=True)
class ReconstructionPrompt:
    """What precedes each chunk of the context in a reconstruction pass."""

    prefix: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prefix or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                      for t in self.prefix):
            raise InvalidArgumentError(f"reconstruction prompt: prefix {self.prefix!r} must be token ids >= 0")

    def chunk_tokens(self, context: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """One reconstruction pass's input: the prefix, then that chunk of the context."""
        return self.prefix + tuple(int(t) for t in context)


def _chat_suffix(tokenizer: Any) -> str | None:
    """The chat template's text for the reconstruction turn after an assistant reply, or None."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None or not getattr(tokenizer, "chat_template", None):
        return None
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        head = apply(before, tokenize=False)
        full = apply(before + [{"role": "user", "content": REQUEST}], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render these turns: use the plain prefix
        return None
    if not isinstance(head, str) or not isinstance(full, str) or not full.startswith(head):
        return None
    return full[len(head):] or None


def reconstruction_prompt(tokenizer: Any) -> ReconstructionPrompt:
    """The reconstruction prefix for `tokenizer`'s model (see the module docstring)."""
    text = _chat_suffix(tokenizer) or PLAIN_PREFIX
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer without that keyword adds no special tokens to plain text
        ids = tokenizer.encode(text)
    return ReconstructionPrompt(tuple(int(t) for t in ids))
