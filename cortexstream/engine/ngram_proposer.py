"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of a sequence's tail.

One `NgramIndex` per sequence holds its tokens (prompt + accepted output) and, for every gram size 1..n_max, a
dict from the gram to the start of its latest occurrence that has a token after it. Adding a token records the
n_max grams it completes, so a step costs O(n_max) dict updates and a proposal O(n_max) lookups, whatever the
length of the history. Rejected drafts never enter the index (only accepted tokens are added); `truncate` rolls
tokens back anyway (a fork or a rewound sequence), in time proportional to the tokens removed.
"""

from __future__ import annotations

from typing import Iterable

from cortexstream.errors import InvalidArgumentError

_NONE = -1


class NgramIndex:
    """The n-gram index of one sequence's tokens, matching grams of 1..n_max tokens."""

    def __init__(self, n_max: int) -> None:
        if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 1:
            raise InvalidArgumentError(f"n_max: {n_max!r} must be an integer >= 1")
        self.n_max = n_max
        self._tokens: list[int] = []
        # _latest[g - 1]: gram of g tokens -> start of its latest occurrence followed by a token.
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max)]
        # _previous[g - 1][s]: the occurrence of the gram starting at s recorded before it (or _NONE), so that
        # truncation can put the older occurrence back. Index s holds the gram recorded when token s + g arrived.
        self._previous: list[list[int]] = [[] for _ in range(n_max)]

    @classmethod
    def from_tokens(cls, tokens: Iterable[int], n_max: int) -> "NgramIndex":
        """An index of `tokens` (a re-admitted or forked sequence rebuilding from its token list)."""
        index = cls(n_max)
        index.extend(tokens)
        return index

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens. Each new token completes the continuation of the grams that end just before
        it, which are recorded then: a recorded gram always has a token after it."""
        for token in tokens:
            self._append(int(token))

    def _append(self, token: int) -> None:
        toks = self._tokens
        end = len(toks)  # the new token's position; grams ending at end - 1 now have a continuation
        toks.append(token)
        for g in range(1, min(self.n_max, end) + 1):
            start = end - g
            gram = tuple(toks[start:end])
            table = self._latest[g - 1]
            self._previous[g - 1].append(table.get(gram, _NONE))
            table[gram] = start

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens, forgetting the grams the removed tokens completed."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= len(self._tokens):
            raise InvalidArgumentError(f"length: {length!r} must be an integer in 0..{len(self._tokens)}")
        toks = self._tokens
        for end in range(len(toks) - 1, length - 1, -1):  # undo the appends, newest first
            for g in range(min(self.n_max, end), 0, -1):
                start = end - g
                previous = self._previous[g - 1].pop()
                gram = tuple(toks[start:end])
                if previous == _NONE:
                    del self._latest[g - 1][gram]
                else:
                    self._latest[g - 1][gram] = previous
            toks.pop()

    def match(self, n: int) -> tuple[int, int] | None:
        """(start, size) of the latest earlier occurrence of the last `size` tokens, for the largest size in
        n, n-1, ..., 1 that has one; None when even the last token never occurred before."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.n_max:
            raise InvalidArgumentError(f"n: {n!r} must be an integer in 1..{self.n_max} (this index's n_max)")
        toks = self._tokens
        for g in range(min(n, len(toks)), 0, -1):
            start = self._latest[g - 1].get(tuple(toks[-g:]))
            if start is not None:
                return start, g
        return None

    def extent(self, start: int, size: int, cap: int) -> int:
        """How many of the last tokens equal those ending where the occurrence of the last `size` tokens at `start`
        ends (what `match` returned), counted back from the gram up to `cap`: the length of the copy so far."""
        toks = self._tokens
        if not (0 <= start and 1 <= size and start + size < len(toks) and toks[start:start + size] == toks[-size:]):
            raise InvalidArgumentError(f"start, size: ({start}, {size}) is not an earlier occurrence of the last "
                                       f"{size} tokens")
        extent, i, j = size, start - 1, len(toks) - size - 1
        while extent < cap and i >= 0 and toks[i] == toks[j]:
            extent, i, j = extent + 1, i - 1, j - 1
        return extent

    def propose(self, k: int, n: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last `n` tokens.

        As prompt-lookup decoding does, when the last n tokens never occurred before, the last n-1 are tried,
        then n-2, ... down to the last token alone; nothing matches -> []. The occurrence is always an earlier
        one (the tail itself has no continuation yet, so it is never recorded), and fewer than k tokens come
        back when the match lies near the end of the sequence.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidArgumentError(f"k: {k!r} must be an integer >= 0")
        found = self.match(n)
        if found is None or k == 0:
            return []
        start, size = found
        begin = start + size
        return self._tokens[begin:begin + k]

