"""Grammars for one tokenizer: builds llguidance's view of the vocabulary once, then a matcher per request.

llguidance rather than xgrammar: it compiles a new schema far faster, enforces keywords xgrammar ignores
(`multipleOf`), and needs no PyTorch (xgrammar's wheel requires torch and triton); measured in docs/agents.md
(`bench/grammar_engines.py`). The vocabulary view is costly, so it is built on the first constrained request (or
by `warm()`), never for an engine that never sees one.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Iterable

from cortexstream.errors import InvalidArgumentError
from cortexstream.grammar.constraint import TokenConstraint
from cortexstream.grammar.spec import GrammarSpec


class GrammarCompiler:
    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids if t is not None)
        self._lltokenizer: Any = None
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []  # per matcher made (bounded: the last 4096)

    def lltokenizer(self) -> Any:
        """llguidance's tokenizer for this vocabulary (built once). InvalidArgumentError if it cannot be made."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = self._build()
            return self._lltokenizer

    def _build(self) -> Any:
        import llguidance

        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise InvalidArgumentError("response_format: constrained output needs a fast (Rust `tokenizers`) "
                                       f"tokenizer; this model's is {type(self.tokenizer).__name__}")
        if not self.eos_token_ids:
            raise InvalidArgumentError("response_format: the tokenizer has no end-of-sequence token, so a "
                                       "constrained completion could never end")
        plain = copy.copy(backend)  # padding/truncation off on a copy, not the caller's
        plain.no_padding()
        plain.no_truncation()
        return llguidance.LLTokenizer(plain.to_str(), eos_token=self.eos_token_ids)

    def warm(self) -> None:
        self.lltokenizer()

    @property
    def vocab_size(self) -> int:
        return int(self.lltokenizer().vocab_size)

    def constraint(self, spec: GrammarSpec) -> TokenConstraint:
        """A fresh matcher for `spec`. InvalidArgumentError naming the spec's field if it cannot be enforced."""
        import llguidance

        grammar = spec.check()
        tokenizer = self.lltokenizer()
        tic = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        seconds = time.perf_counter() - tic
        if matcher.is_error():
            raise InvalidArgumentError(f"{spec.name}: cannot be enforced: {matcher.get_error()}")
        if len(self.compile_seconds) >= 4096:
            del self.compile_seconds[:2048]
        self.compile_seconds.append(seconds)
        return TokenConstraint(matcher, seconds)
