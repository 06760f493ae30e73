"""Passkey prompts for `bench quality` and `bench frontier`: a needle sentence hidden in filler text.

The filler sentences never appear in the Wikipedia text (`cortexstream.evaluation.wiki_corpus`) that the
trainers learn from, so no training run has seen a passkey haystack.
"""

from __future__ import annotations

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer: object, total_tokens: int, depth: float, passkey: str) -> tuple[list[int], int]:
    """Token ids of a haystack of about `total_tokens` with the passkey sentence at `depth` (0..1) of the filler,
    and the index where the needle starts (everything before it does not depend on the passkey)."""
    encode = tokenizer.encode  # type: ignore[attr-defined]
    task, question = encode(TASK), encode(QUESTION)
    needle = encode(f" The pass key is {passkey}. Remember it. {passkey} is the pass key. ")
    filler_unit = encode(FILLER)
    room = total_tokens - len(task) - len(question) - len(needle)
    filler = (filler_unit * (room // len(filler_unit) + 1))[:room]
    cut = int(round(depth * room))
    prefix = task + filler[:cut]
    return prefix + needle + filler[cut:] + question, len(prefix)
