"""How far a prompt-lookup match reaches back, and what that says about its draft being accepted. Pure Python.

A proposal continues the latest earlier occurrence of the sequence's last n tokens (engine/ngram_proposer.py). The
match's extent is how many tokens before the tail agree with those before that occurrence (at least the matched
gram's size): a chance match of one common token has extent 1, an output copying a stretch of its input has an
extent that grows with every copied token. It is the best single predictor of acceptance measured here (SmolLM2,
greedy, the four tasks of `bench speculative`; docs/speculative.md): a draft's first token is accepted about 20 % of
the time at extent 1 and 95 % from extent 17 on. So the adaptive draft length keeps its rates per class of extent
(engine/adaptive_draft.py, `contexts`), starting from these measured rates as priors and following each sequence's
own outcomes from there.
"""

from __future__ import annotations

from cortexstream.errors import InvalidArgumentError

# Each class is named by the smallest extent it holds: 1, 2-3, 4-8, 9-16, 17 and more.
EXTENT_CLASSES = (1, 2, 4, 9, 17)
# Extents are counted up to this many tokens: every longer one is in the last class anyway.
EXTENT_CAP = EXTENT_CLASSES[-1]
# Per class: (first drafted token's acceptance, each later token's given the ones before it), measured as above
# and rounded down a little, so that a workload unlike the measured one has to earn its drafts.
EXTENT_PRIORS: dict[int, tuple[float, float]] = {1: (0.2, 0.6), 2: (0.55, 0.7), 4: (0.75, 0.8), 9: (0.9, 0.9),
                                                 17: (0.95, 0.95)}


def extent_class(extent: int) -> int:
    """The class of a match of `extent` tokens (>= 1): the largest class start not above it."""
    if isinstance(extent, bool) or not isinstance(extent, int) or extent < 1:
        raise InvalidArgumentError(f"extent: {extent!r} must be an integer >= 1")
    return max(c for c in EXTENT_CLASSES if c <= extent)


__all__ = ["EXTENT_CAP", "EXTENT_CLASSES", "EXTENT_PRIORS", "extent_class"]
