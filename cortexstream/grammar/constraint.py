"""One request's grammar state: which tokens may come next, advanced by each token it samples.

A `TokenConstraint` wraps an llguidance matcher. `allowed(vocab_size)` is the next token's mask as an MLX boolean
array (the mask is computed on the host, so it works on every backend); `consume(token)` advances it. Token ids
past the tokenizer's vocabulary (padded embedding rows) are never allowed. When the grammar is complete the
matcher allows only the end-of-sequence tokens, so a constrained completion ends with a whole match.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from cortexstream.errors import GenerationError


class ConstraintViolation(GenerationError):
    """The grammar could not go on: a token it does not allow, or the matcher failed (its reason is given)."""


class TokenConstraint:
    def __init__(self, matcher: Any, compile_seconds: float) -> None:
        self.matcher = matcher
        self.compile_seconds = compile_seconds
        self.mask_seconds = 0.0  # host time spent computing masks (diagnostic)
        self._bits: np.ndarray | None = None

    def _check(self, what: str) -> None:
        if self.matcher.is_error():
            raise ConstraintViolation(f"the output grammar failed {what}: {self.matcher.get_error()}")

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            self._check(f"at token {token}")
            raise ConstraintViolation(f"token {token} is not allowed by the output grammar here")

    def replay(self, tokens: Sequence[int]) -> None:
        """Advance over tokens already generated (a request re-created after a preemption)."""
        for token in tokens:
            self.consume(token)

    @property
    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    def allowed_bits(self) -> np.ndarray:
        """The mask as packed bits (uint8, little-endian bit order: token t is bit t % 8 of byte t // 8)."""
        tic = time.perf_counter()
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check("computing the next token's mask")
        self.mask_seconds += time.perf_counter() - tic
        return packed

    def allowed(self, vocab_size: int) -> mx.array:
        """`[vocab_size]` bool: True where the next token may be that id."""
        bits = np.unpackbits(self.allowed_bits(), bitorder="little").astype(bool)
        if bits.size >= vocab_size:
            bits = bits[:vocab_size]
        else:
            bits = np.concatenate([bits, np.zeros(vocab_size - bits.size, dtype=bool)])
        if not bits.any():
            raise ConstraintViolation("the output grammar allows no token here")
        return mx.array(bits)


def apply_mask(logits: mx.array, allowed: mx.array) -> mx.array:
    """Logits with every disallowed token at -inf (logits `[1, V]` or `[V]`, allowed `[V]`)."""
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
