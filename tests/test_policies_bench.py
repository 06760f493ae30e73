"""`bench quality` building blocks that need no real model: text cleaning, passkey prompts, the report."""

from __future__ import annotations

import json

from cortexstream.benchmarks.quality import expected_but_absent
from cortexstream.benchmarks.passkey import passkey_prompt
from cortexstream.evaluation.wiki_corpus import strip_wiki
from cortexstream.benchmarks.common import write_report
from cortexstream.benchmarks.quality_report import markdown, plot


def test_strip_wiki_keeps_prose_and_drops_markup():
    raw = ("{{Infobox|name=x|{{nested}}}}'''Anarchism''' is a [[political philosophy]] that advocates "
           "[[self-governance|self-governed]] societies<ref>cite</ref> based on voluntary institutions.\n"
           "== History ==\n* a list item that is long enough to count as words here\n"
           "{| class=wikitable\n| cell |}\n[[Category:Anarchism]]")
    text = strip_wiki(raw)
    assert text == ("Anarchism is a political philosophy that advocates self-governed societies based on "
                    "voluntary institutions.")


def test_passkey_prompt_places_the_needle_at_the_depth(tiny):
    _, tokenizer = tiny
    for depth in (0.1, 0.5, 0.9):
        ids, needle_at = passkey_prompt(tokenizer, 400, depth, "12345")
        assert abs(len(ids) - 400) <= 2
        text = tokenizer.decode(ids)
        assert "12345" in tokenizer.decode(ids[needle_at : needle_at + 40])
        assert "12345" not in tokenizer.decode(ids[:needle_at])
        assert text.endswith("The pass key is")
    starts = [passkey_prompt(tokenizer, 1200, d, "11111")[1] for d in (0.1, 0.5, 0.9)]
    assert starts[0] < starts[1] < starts[2]
    assert abs((starts[2] - starts[1]) - (starts[1] - starts[0])) <= 1  # evenly spaced in the filler


def _data():
    return {
        "settings": {"model": "m", "text_source": "t", "contexts": [64], "passkey_contexts": [64],
                     "passkey_policies": ["full", "h2o:budget=0.2"], "ppl_chunk": 16, "full_chunk": 256,
                     "passkey_trials": 2, "passkey_chunk": 64, "stream_tokens": 128, "stream_cache": 32},
        "machine": {"device": "cpu", "cpu_count": 2, "blas": "x"},
        "perplexity": [{"context": 64, "policy": "full", "spec": "full", "budget_tokens": 64, "chunk": 256,
                        "ppl": 10.0, "seconds": 1.0},
                       {"context": 64, "policy": "h2o@0.2", "spec": "h2o:budget=0.2,sinks=4", "budget_tokens": 13,
                        "chunk": 16, "ppl": 11.0, "seconds": 1.0}],
        "passkey": [{"context": 64, "policy": "full", "budget_tokens": 64, "trials": 2, "correct": 1,
                     "accuracy": 0.5, "results": [{"correct": True}, {"correct": False}], "seconds": 2.0}],
        "streaming": [], "chunkcheck": [], "restart": [],
    }


def test_report_lists_what_is_missing_and_writes_files(tmp_path):
    data = _data()
    missing = expected_but_absent(data, [0.2], 16)
    assert "passkey context=64 h2o:budget=0.2" in missing and "perplexity context=64 streaming@0.2" in missing
    assert "perplexity context=64 h2o@0.2" not in missing and any("streaming" in m for m in missing)
    data["missing"] = missing
    text = markdown(data)
    assert "| 64 | h2o:budget=0.2,sinks=4 | 13 | 11.000 | +10.0% |" in text and "`✓·`" in text
    assert "Not measured" in text
    write_report(str(tmp_path), "quality", data, markdown(data), plot)
    assert json.load(open(tmp_path / "quality.json"))["perplexity"][1]["ppl"] == 11.0
    assert (tmp_path / "quality.md").exists()
