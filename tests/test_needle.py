"""Needle in a heap on the tiny model: prompt layout, the answer NLL equals teacher-forced scoring, policies
shrink the physical cache, bad input fails early."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.evaluation.needle import needle_prompt, run_needle
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from tiny_models import random_token_ids


def test_prompt_layout(tiny):
    _, tokenizer = tiny
    heap = random_token_ids(400, seed=1)
    ids, at, answer = needle_prompt(tokenizer, heap, 300, 0.5, "Dr. Ellington", "482916")
    other, at2, _ = needle_prompt(tokenizer, heap, 300, 0.5, "Dr. Ellington", "111111")
    assert at == at2 and ids[:at] == other[:at]  # the prefix does not depend on the needle: it can be shared
    assert "482916" in tokenizer.decode(ids[at:at + 40]) and abs(len(ids) - 300) <= 2
    assert tokenizer.decode(answer).strip() == "482916"
    assert tokenizer.decode(ids).rstrip().endswith("The vault code for Dr. Ellington is")
    with pytest.raises(InvalidArgumentError, match="heap tokens"):
        needle_prompt(tokenizer, heap[:50], 300, 0.5, "Dr. Ellington", "482916")


def test_cells(tiny):
    model, tokenizer = tiny
    heap = random_token_ids(400, seed=2)
    rows = run_needle(model, tokenizer, ["full", "streaming:budget=48,sinks=4", "meanpool:window=4,sinks=4,recent=16"],
                      contexts=(320,), trials=3, chunk=16, heap=heap, log=lambda _: None)
    assert [r["policy"] for r in rows] == ["full", "streaming:budget=48,sinks=4", "meanpool:window=4,sinks=4,recent=16"]
    full, streaming, pooled = rows
    assert full["physical_tokens"] > 300 and streaming["physical_tokens"] <= 48 and pooled["physical_tokens"] < 120
    for row in rows:
        assert row["trials"] == 3 and 0 <= row["accuracy"] <= 1 and np.isfinite(row["answer_nll"])
        assert [r["code"] for r in row["results"]] == [r["code"] for r in full["results"]]  # same trials
    # the full-cache answer NLL is the teacher-forced NLL of the code tokens after the prompt
    for trial in full["results"]:
        ids, _, answer = needle_prompt(tokenizer, heap, 320, trial["depth"], trial["name"], trial["code"])
        expected = token_nlls(model, ids + answer, None)[-len(answer):].mean()
        assert trial["answer_nll"] == pytest.approx(expected, abs=1e-3)
    assert streaming["answer_nll"] != full["answer_nll"]


def test_bad_input(tiny):
    model, tokenizer = tiny
    with pytest.raises(InvalidArgumentError, match="kv_policy"):
        run_needle(model, tokenizer, ["nonsense"], heap=random_token_ids(300), log=lambda _: None)
    with pytest.raises(InvalidArgumentError, match="trials"):
        run_needle(model, tokenizer, ["full"], trials=0, heap=random_token_ids(300), log=lambda _: None)
