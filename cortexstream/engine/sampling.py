"""Validated sampling parameters, turned into mlx-lm samplers and logits processors."""

from __future__ import annotations

from contextlib import contextmanager

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from cortexstream.errors import InvalidArgumentError
from cortexstream.grammar.spec import GrammarSpec, grammar_for


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    grammar: GrammarSpec | None = None  # what the output must match (a JSON schema, ...), enforced per token

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, rule: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{name}: {value!r} is invalid, {rule}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty is not None and (
            not _is_number(self.repetition_penalty)
            or not math.isfinite(self.repetition_penalty)
            or self.repetition_penalty <= 0
        ):
            raise bad("repetition_penalty", self.repetition_penalty, "must be a finite number > 0")
        if not _is_int(self.repetition_context_size) or self.repetition_context_size < 1:
            raise bad("repetition_context_size", self.repetition_context_size, "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 0")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be a sequence of non-empty strings")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", self.seed, "must be an integer in [0, 2**64) (MLX seeds are unsigned 64-bit)")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise bad("grammar", self.grammar, "must be a GrammarSpec (see cortexstream.grammar.grammar_for)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_sampler(self) -> Callable:
        """mlx-lm's sampler for these parameters. A `top_k` not below the vocabulary keeps every token (mlx-lm
        would raise), so it is applied only when it filters something."""
        from mlx_lm.sample_utils import make_sampler

        without_k = make_sampler(temp=self.temperature, top_p=self.top_p, min_p=self.min_p)
        if self.top_k <= 0:
            return without_k
        with_k = make_sampler(temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)
        return lambda logprobs: with_k(logprobs) if self.top_k_filters(logprobs.shape[-1]) else without_k(logprobs)

    def top_k_filters(self, vocab_size: int) -> bool:
        """Whether `top_k` removes anything from a vocabulary of this size (one not below it keeps every token)."""
        return 0 < self.top_k < vocab_size

    def make_logits_processors(self) -> list[Callable]:
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(
            repetition_penalty=self.repetition_penalty, repetition_context_size=self.repetition_context_size
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_from_kwargs(
    max_tokens: int = 256,
    *,
    temperature: float | None = None,
    temp: float | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    stop: Any = (),
    seed: int | None = None,
    response_format: Any = None,
    **unknown: Any,
) -> SamplingParams:
    """mlx-lm spells temperature `temp`; accept both, refuse conflicting values and unknown names.
    `response_format`: a JSON schema (dict or text), a pydantic model class or a GrammarSpec the output must match."""
    if unknown:
        raise InvalidArgumentError(f"{', '.join(sorted(unknown))}: unknown generation argument(s); sampling takes "
                                   "temperature/temp, top_p, top_k, min_p, repetition_penalty, "
                                   "repetition_context_size, stop, seed, response_format")
    if stop is not None and not isinstance(stop, str) and not isinstance(stop, (list, tuple)):
        raise InvalidArgumentError(f"stop: {stop!r:.40} must be a string or a list of strings")
    if temperature is not None and temp is not None and temperature != temp:
        raise InvalidArgumentError(f"temperature: got both temperature={temperature} and temp={temp}")
    chosen = temperature if temperature is not None else (temp if temp is not None else 0.0)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(
        temperature=chosen,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        max_tokens=max_tokens,
        stop=stops,
        seed=seed,
        grammar=grammar_for(response_format),
    )


@contextmanager
def keep_random_state() -> Iterator[None]:
    """Restore MLX's global random state if the block raises.

    mlx-lm's samplers are `mx.compile`d with `mx.random.state` as input and output: an exception while one is
    traced (a `top_k` not below the vocabulary size, say) leaves a placeholder array in the state, and every later
    random draw in the process then fails ("Attempting to eval an array without a primitive"). One request's bad
    parameters must not break the others, so the key from before the block is put back.
    """
    import mlx.core as mx

    saved = mx.random.state[0]  # the array object from before the block: a real (possibly lazy) key
    try:
        yield
    except BaseException:
        # The state cannot be assigned from Python, but a key is two uint32 words and `seed(hi << 32 | lo)` sets
        # exactly that key. Only this failure path pays the evaluation.
        high, low = (int(word) for word in saved.tolist())
        mx.random.seed((high << 32) | low)
        raise

