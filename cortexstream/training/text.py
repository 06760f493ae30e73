"""Training text for the sidecar, kept disjoint from what `cortexstream bench quality` evaluates on.

Held-out rule. `bench quality` scores perplexity on the first ~20k tokens of `wiki_corpus.wiki_text()` and
builds passkey prompts from `benchmarks.passkey.FILLER`. Trajectories therefore come from the same Wikipedia dump but
only from token `skip` on (default 65536, more than three times the evaluated span), and the held-out evaluation
rows of `train sidecar` from a separate stretch after the training tokens, so neither training nor model
selection sees evaluated text. The filler sentences never appear in the dump. Other sources: "pydoc" (the
Python documentation topics that ship with CPython, `pydoc_data`) or a path to a UTF-8 text file. Each
description string is recorded in the trajectory metadata and the shipped weights' README.
"""

from __future__ import annotations

import os
from typing import Any

from cortexstream.errors import InvalidArgumentError

DEFAULT_SKIP = 65536  # tokens of wiki_text never used for training (bench quality reads the first ~20k)


def source_text(source: str) -> tuple[str, str]:
    """(text, description) for "wiki", "pydoc" or a text file path."""
    if source == "wiki":
        from cortexstream.evaluation.wiki_corpus import wiki_text

        return wiki_text()
    if source == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data topics (CPython documentation)"
    if not os.path.isfile(source):
        raise InvalidArgumentError(f"--source: '{source}' is not 'wiki', 'pydoc' or an existing text file")
    with open(source, encoding="utf-8") as fh:
        return fh.read(), f"text file {os.path.abspath(source)}"


def token_sequences(tokenizer: Any, source: str, *, skip: int, sequence_length: int,
                    count: int) -> tuple[list[list[int]], str, int]:
    """`count` consecutive sequences of `sequence_length` tokens starting `skip` tokens into the source.

    Returns (sequences, source description, number of tokens in the source); sequence i covers tokens
    [skip + i * sequence_length, skip + (i + 1) * sequence_length), so a caller can split them into disjoint
    training and evaluation stretches.
    """
    if sequence_length < 2 or count < 1 or skip < 0:
        raise InvalidArgumentError(f"sidecar data: sequence_length {sequence_length} >= 2, count {count} >= 1 and "
                                   f"skip {skip} >= 0 required")
    text, description = source_text(source)
    ids = list(tokenizer.encode(text))
    end = skip + sequence_length * count
    if end > len(ids):
        have = max(0, (len(ids) - skip) // sequence_length)
        raise InvalidArgumentError(f"sidecar data: {source} has {len(ids)} tokens; {count} sequences of "
                                   f"{sequence_length} after token {skip} need {end} (room for {have})")
    seqs = [ids[skip + i * sequence_length: skip + (i + 1) * sequence_length] for i in range(count)]
    return seqs, description, len(ids)
