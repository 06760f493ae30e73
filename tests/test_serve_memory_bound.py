"""`cortexstream bench serve --workloads memory_bound`: the workload, the options, the peers' commands, the gauge
sampling, the report's ratios and verdicts, and an end-to-end run of CortexStream alone on a tiny model."""

from __future__ import annotations

import argparse
import json

import pytest

from cortexstream.benchmarks.serve_client import RequestRecord
from cortexstream.benchmarks.serve_memory import budget_tokens, read_gauges, streaming_concurrency
from cortexstream.benchmarks.serve_memory_options import MemoryBoundOptions, parse_kv_dtypes, parse_peer_pythons
from cortexstream.benchmarks.serve_memory_report import memory_markdown, memory_ratios
from cortexstream.benchmarks.serve_processes import Launch, Peer, command
from cortexstream.benchmarks.serve_workloads import MEMORY_BOUND, memory_bound, memory_bound_workload
from cortexstream.errors import InvalidArgumentError


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_memory_bound_workload_is_seeded_and_sized(tiny):
    tokenizer = tiny[1]._tokenizer
    a = memory_bound(tokenizer, seed=5, sessions=6, history_tokens=120, turns=3, user_tokens=(10, 14),
                     new_tokens=(64, 128))
    assert a == memory_bound(tokenizer, seed=5, sessions=6, history_tokens=120, turns=3, user_tokens=(10, 14),
                             new_tokens=(64, 128))
    assert a != memory_bound(tokenizer, seed=6, sessions=6, history_tokens=120, turns=3, user_tokens=(10, 14),
                             new_tokens=(64, 128))
    assert a.name == MEMORY_BOUND and len(a.sessions) == 6
    assert all(s.start == 0.0 for s in a.sessions)  # all at once
    assert len({s.system for s in a.sessions}) == 6  # nothing shared between conversations
    for session in a.sessions:
        assert _tokens(tokenizer, session.system) in range(114, 127)
        assert len(session.turns) == 3
        assert all(64 <= t.max_tokens <= 128 and _tokens(tokenizer, t.user_text) in range(8, 17)
                   for t in session.turns)
    quick = memory_bound_workload(tokenizer, seed=0, quick=True, sessions=None, history_tokens=1500)
    assert len(quick.sessions) == 3 and len(quick.sessions[0].turns) == 2
    full = memory_bound_workload(tokenizer, seed=0, quick=False, sessions=None, history_tokens=1500)
    assert len(full.sessions) == 32 and _tokens(tokenizer, full.sessions[0].system) in range(1490, 1501)
    with pytest.raises(ValueError, match="sessions"):
        memory_bound(tokenizer, seed=0, sessions=0)


def test_kv_dtype_list_and_peer_options(tmp_path):
    assert parse_kv_dtypes("float32, int8,k=int8,v=int4,int4") == ("float32", "int8", "k=int8,v=int4", "int4")
    with pytest.raises(InvalidArgumentError, match="--kv-dtypes: 'int3'"):
        parse_kv_dtypes("float32,int3")
    with pytest.raises(InvalidArgumentError, match="twice"):
        parse_kv_dtypes("int8,int8")
    with pytest.raises(InvalidArgumentError, match="--kv-group-size"):
        parse_kv_dtypes("float32,float16", group_size=32)
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("")
    (bin_dir / "vllm-mlx").write_text("")
    python = str(bin_dir / "python")
    assert parse_peer_pythons([f"vllm-mlx={python}"]) == {Peer.VLLM_MLX: python}
    for item, message in ((f"mlx_vlm={python}", "no mlx_vlm.server beside"), (f"ollama={python}", "not a peer"),
                          ("vllm_mlx", "NAME=/path"), (f"vllm_mlx={tmp_path}/none", "not a file")):
        with pytest.raises(InvalidArgumentError, match=f"--peer-python: .*{message}"):
            parse_peer_pythons([item])


def test_peer_commands_turn_their_kv_quantization_on():
    python = "/venvs/peer/bin/python"
    vlm = command(Launch("mlx_vlm", None, 32, python=python, kv_bits=8), "/m", 9000)
    assert vlm[0] == "/venvs/peer/bin/mlx_vlm.server" and vlm[-2:] == ["--kv-bits", "8"]
    assert vlm[vlm.index("--max-num-seqs") + 1] == "32"
    rapid = command(Launch("rapid_mlx", None, 32, python=python, kv_bits=4), "/m", 9000)
    assert rapid[:4] == ["/venvs/peer/bin/rapid-mlx", "--no-telemetry", "serve", "/m"]
    assert rapid[-2:] == ["--kv-cache-dtype", "int4"]
    vllm = command(Launch("vllm_mlx", None, 32, python=python, kv_bits=8), "/m", 9000)
    assert "--continuous-batching" in vllm
    assert vllm[-3:] == ["--kv-cache-quantization", "--kv-cache-quantization-bits", "8"]
    ours = command(Launch("cortexstream", 4096, 32, kv_dtype="int8", kv_group_size=32), "/m", 9000)
    assert ours[-4:] == ["--kv-dtype", "int8", "--kv-group-size", "32"]
    assert ours[ours.index("--kv-tokens") + 1] == "4096"
    with pytest.raises(ValueError, match="python"):
        Launch("vllm_mlx", None, 32)
    with pytest.raises(ValueError, match="kv_dtype"):
        Launch("mlx_lm", None, 32, kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_tokens"):
        Launch("cortexstream", None, 32)


def test_gauges_and_client_concurrency():
    ours = ('# HELP cortexstream:num_requests_running x\n# TYPE cortexstream:num_requests_running gauge\n'
            'cortexstream:num_requests_running{model_name="m"} 3\ncortexstream:num_requests_waiting{model_name="m"} 5\n'
            'cortexstream:kv_blocks_used{model_name="m"} 40\n')
    assert read_gauges(ours) == (3.0, 5.0)
    assert read_gauges("vllm_mlx_scheduler_running_requests 2.0\nvllm_mlx_scheduler_waiting_requests 0.0\n") == \
        (2.0, 0.0)
    assert read_gauges("process_resident_memory_bytes 1e9\n") == (None, None)
    records = [RequestRecord(sent=0.0, first_token=1.0, last_token=3.0),
               RequestRecord(sent=0.0, first_token=2.0, last_token=4.0),
               RequestRecord(sent=0.0, first_token=4.0, last_token=5.0),  # starts as the second ends
               RequestRecord(sent=0.0, error="HTTP 400")]
    peak, mean = streaming_concurrency(records, 0.0, 5.0)
    assert peak == 2 and mean == pytest.approx((2 + 2 + 1) / 5)


def _run(label, kv_dtype, quantized, running_peak, tps, system="cortexstream"):
    return {"label": label, "system": system, "kv_dtype": kv_dtype, "kv_quantized": quantized,
            "kv_storage": kv_dtype or "model float type", "kv_budget_enforced": system == "cortexstream",
            "kv_bytes": 2**28, "bytes_per_token": 1000, "kv_tokens": 2**28 // 1000, "running_peak": running_peak,
            "running_mean": running_peak and running_peak / 2, "streaming_peak": 4, "streaming_mean": 2.0,
            "output_tokens_per_s": tps, "ttft_p50_s": 0.5, "ttft_p95_s": 1.5, "completed": 10, "failed": 0,
            "errors": [], "peak_rss_mib": 900.0}


def test_ratios_judge_the_targets_from_the_numbers():
    runs = [_run("cortexstream float32", "float32", False, 4, 100.0),
            _run("cortexstream int8", "int8", True, 8, 120.0), _run("cortexstream int4", "int4", True, 16, 90.0),
            _run("mlx_lm.server", None, None, None, 80.0, system="mlx_lm"),
            {"label": "vllm_mlx", "system": "vllm_mlx", "kv_storage": "--kv-cache-quantization", "error": "exit 2"}]
    ratios = {r["label"]: r for r in memory_ratios(runs)}
    assert set(ratios) == {"cortexstream int8", "cortexstream int4", "mlx_lm.server"}
    int8, int4 = ratios["cortexstream int8"], ratios["cortexstream int4"]
    assert int8["running_peak"] == 2.0 and int8["meets_running"] and int8["meets_throughput"]
    assert int4["running_peak"] == 4.0 and int4["meets_running"] and int4["meets_throughput"] is False
    assert ratios["mlx_lm.server"]["meets_running"] is None and ratios["mlx_lm.server"]["running_peak"] is None
    section = {"name": MEMORY_BOUND, "description": "d", "sessions": 32, "kv_budget_mib": 256.0,
               "sample_interval_s": 0.25, "longest_conversation_tokens": 2000, "runs": runs,
               "ratios": list(ratios.values())}
    text = "\n".join(memory_markdown(section))
    assert "| cortexstream int8 | int8 | 256.00 | 1000 | 268435 | 8 | 4.0 | 4 | 2.0 | 120.0 | 500 | 1500 | 10 | 0 " \
           "| 900 |" in text
    assert "running peak 2.00x (target >= 1.9x: met)" in text
    assert "output tok/s 0.90x (target >= 1.0x: missed)" in text
    assert "| mlx_lm.server | model float type | not enforced |" in text and "- vllm_mlx: exit 2" in text
    assert "not held" in text  # the peers' budget is said not to be enforced
    assert memory_ratios([r for r in runs if r.get("kv_quantized") is not False]) == []


def test_budget_tokens_follow_the_storage(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5, "vocab_size": 300,
        "rope_theta": 10000.0, "tie_word_embeddings": True}))
    tokens32, per_token32 = budget_tokens(tmp_path, "float32", None, 2**20)
    assert per_token32 == 2 * 2 * 2 * 32 * 4 and tokens32 == 2**20 // per_token32
    tokens8, per_token8 = budget_tokens(tmp_path, "int8", 32, 2**20)
    assert per_token8 < per_token32 / 3 and tokens8 * per_token8 <= 2**20 and tokens8 % 16 == 0


def test_memory_bound_end_to_end_on_a_tiny_model(tmp_path):
    """CortexStream alone, float32 and int8 at one tiny budget, three short conversations: the whole pipeline."""
    from tiny_models import TINY_CONFIG, tiny_model, write_tiny_gguf

    from cortexstream.cli.main import main

    gguf = str(tmp_path / "tiny32.gguf")
    write_tiny_gguf(gguf, tiny_model(seed=3, head_dim=32), config={**TINY_CONFIG, "head_dim": 32})
    out = tmp_path / "out"
    code = main(["bench", "serve", "--quick", "--model", gguf, "--workloads", "memory-bound", "--systems",
                 "cortexstream", "--kv-dtypes", "float32,int8", "--kv-group-size", "32", "--kv-budget-mib", "0.25",
                 "--sessions", "3", "--sample-interval", "0.05", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "serve_memory_bound_quick.json").read_text())
    assert result["workloads"] == []
    section = result["memory_bound"]
    assert section["sessions"] == 3 and section["kv_budget_bytes"] == 2**18
    f32, i8 = section["runs"]
    assert (f32["label"], i8["label"]) == ("cortexstream float32", "cortexstream int8")
    for run in (f32, i8):
        assert run["failed"] == 0 and run["completed"] == 6 and run["output_tokens"] > 0
        assert run["kv_bytes"] <= 2**18 and run["kv_bytes"] == run["kv_tokens"] * run["bytes_per_token"]
        assert run["gauge_samples"] >= 1 and 1 <= run["running_peak"] <= 3 and run["peak_rss_mib"] > 10
    assert f32["bytes_per_token"] == 1024 and i8["kv_tokens"] > 3 * f32["kv_tokens"]
    (ratio,) = section["ratios"]
    assert ratio["running_peak"] == i8["running_peak"] / f32["running_peak"]
    text = (out / "serve_memory_bound_quick.md").read_text()
    verdict = "met" if ratio["running_peak"] >= 1.9 else "missed"
    assert f"running peak {ratio['running_peak']:.2f}x (target >= 1.9x: {verdict})" in text
    assert str(tmp_path) not in text and (out / "serve_memory_bound_quick.png").stat().st_size > 1000


def test_options_are_checked_before_anything_starts(tmp_path):
    from cortexstream.benchmarks.serve import add_arguments, check_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(InvalidArgumentError, match="--workloads: 'memory'"):
        check_args(parser.parse_args(["--workloads", "memory"]))
    for flags in (["--peer-python", "vllm_mlx=/x"], ["--kv-dtypes", "int8"], ["--sessions", "4"]):
        with pytest.raises(InvalidArgumentError, match=f"{flags[0]}: only the memory_bound workload"):
            check_args(parser.parse_args(flags))  # it would do nothing without the workload
    with pytest.raises(InvalidArgumentError, match="--kv-budget-mib"):
        check_args(parser.parse_args(["--workloads", "memory_bound", "--kv-budget-mib", "0"]))
    with pytest.raises(InvalidArgumentError, match="--kv-dtypes: 'int3'"):
        check_args(parser.parse_args(["--workloads", "memory_bound", "--kv-dtypes", "int8,int3"]))
    assert check_args(parser.parse_args(["--workloads", "memory-bound,unrelated"])) == \
        (["cortexstream", "mlx_lm"], [MEMORY_BOUND, "unrelated"], MemoryBoundOptions())
    _, _, options = check_args(parser.parse_args(["--workloads", "memory_bound", "--kv-dtypes", "auto,k=int8,v=int4",
                                                  "--kv-budget-mib", "64", "--sessions", "8"]))
    assert options.kv_dtypes == ("auto", "k=int8,v=int4") and options.budget_bytes == 64 * 2**20
    assert options.argv()[:4] == ["--kv-dtypes", "auto,k=int8,v=int4", "--kv-budget-mib", "64"]
