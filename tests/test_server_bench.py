"""`cortexstream bench serve`: seeded workloads, the report, and a smoke run of the whole pipeline (tiny model)."""

from __future__ import annotations

from cortexstream.benchmarks.serve_client import RequestRecord, WorkloadRun
from cortexstream.benchmarks.serve_report import (
    SPECULATIVE_SYSTEM, markdown, ratios, servers_compared, summarize)
from cortexstream.benchmarks.serve_workloads import build_workloads, shared_system_chat


def test_workloads_are_seeded_and_sized_in_tokens(tiny):
    _, wrapper = tiny
    tokenizer = wrapper._tokenizer
    a = shared_system_chat(tokenizer, seed=3, users=5, system_tokens=40, user_tokens=(10, 12), new_tokens=(4, 6))
    b = shared_system_chat(tokenizer, seed=3, users=5, system_tokens=40, user_tokens=(10, 12), new_tokens=(4, 6))
    assert a == b
    assert len({s.system for s in a.sessions}) == 1
    assert len(tokenizer.encode(a.sessions[0].system, add_special_tokens=False)) in range(36, 45)
    starts = [s.start for s in a.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] > 0
    quick = build_workloads(tokenizer, seed=0, quick=True, rate=4.0)
    assert [w.name for w in quick] == ["shared_system_chat", "multi_turn", "unrelated"]
    assert [len(t.turns) for t in quick[1].sessions] == [2, 2]


def test_summary_ratios_and_markdown():
    run = WorkloadRun(started=0.0, finished=2.0)
    run.records = [RequestRecord(sent=0.0, first_token=0.5, last_token=1.5, output_tokens=11),
                   RequestRecord(sent=0.0, first_token=1.0, last_token=2.0, output_tokens=11),
                   RequestRecord(sent=0.0, error="HTTP 500")]
    ours = summarize(run, peak_rss=2**30)
    assert ours["failed"] == 1 and ours["output_tokens_per_s"] == 11.0 and ours["empty_replies"] == 0
    # a stream that ended with no text is an empty reply, one that neither sent text nor ended is a failure
    with_empty = WorkloadRun(started=0.0, finished=2.0, records=run.records + [
        RequestRecord(sent=0.0, done=True), RequestRecord(sent=0.0)])
    other = summarize(with_empty, peak_rss=2**30)
    assert other["failed"] == 2 and other["empty_replies"] == 1 and other["ttft_p50_s"] == 0.75
    assert ours["tpot_p50_s"] == 0.1 and ours["ttft_p50_s"] == 0.75
    theirs = dict(ours, output_tokens_per_s=5.5, ttft_p50_s=3.0, peak_rss_mib=2048.0)
    r = ratios("shared_system_chat", ours, theirs)
    assert r["output_tokens_per_s"] == 2.0 and r["meets_throughput"] and r["meets_ttft"] and r["meets_rss"]
    result = {"machine": "Linux x86_64, 2 cores", "model": "m", "seed": 0, "quick": False, "command": "x",
              "workloads": [{"name": "shared_system_chat", "description": "d", "order": ["a", "b"],
                             "systems": {"cortexstream": ours, "mlx_lm": theirs}, "ratios": r}]}
    text = markdown(result)
    assert "| cortexstream | 1.00 | 11.0 | 750 |" in text and "target >= 1.5x: met" in text
    assert text.startswith("# Serving benchmark: cortexstream serve vs mlx_lm.server\n")
    only = dict(result, workloads=[dict(result["workloads"][0], systems={"cortexstream": ours}, ratios=None)])
    assert markdown(only).startswith("# Serving benchmark: cortexstream serve\n")


def test_the_title_names_the_servers_that_ran():
    """Peers in the memory-bound section are named too; one that did not start is not; no "vs" when only
    CortexStream ran."""
    workload = {"name": "unrelated", "systems": {"cortexstream": {}, "mlx_lm": {}}}
    runs = [{"system": "cortexstream"}, {"system": "mlx_lm"}, {"system": "mlx_vlm"}, {"system": "rapid_mlx"},
            {"system": "vllm_mlx", "error": "did not start"}]
    result = {"workloads": [workload], "memory_bound": {"runs": runs}}
    assert servers_compared(result) == "cortexstream serve vs mlx_lm.server, mlx_vlm.server, rapid-mlx"
    runs[-1].pop("error")
    assert servers_compared(result).endswith(", rapid-mlx, vllm-mlx")
    assert servers_compared({"workloads": [], "memory_bound": {"runs": runs[2:]}}) == \
        "mlx_vlm.server, rapid-mlx, vllm-mlx"
    alone = {"workloads": [{"systems": {"cortexstream": {}, SPECULATIVE_SYSTEM: {}}}]}
    assert servers_compared(alone) == "cortexstream serve vs cortexstream serve --speculative"
    assert servers_compared({"workloads": [{"systems": {"cortexstream": {}}}]}) == "cortexstream serve"


def test_bench_serve_quick_smoke_end_to_end(tiny_gguf, tmp_path):
    """Both servers as subprocesses on the converted tiny model, one small workload: the whole pipeline runs."""
    import json

    from cortexstream.cli.main import main

    code = main(["bench", "serve", "--quick", "--model", tiny_gguf, "--workloads", "unrelated", "--kv-tokens",
                 "2048", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "serve_quick.json").read_text())
    (workload,) = result["workloads"]
    assert set(workload["systems"]) == {"cortexstream", "mlx_lm"}
    for summary in workload["systems"].values():
        assert summary["failed"] == 0 and summary["output_tokens"] > 0 and summary["peak_rss_mib"] > 10
    assert "/" not in result["machine"] and str(tmp_path) not in (tmp_path / "serve_quick.md").read_text()
    assert (tmp_path / "serve_quick.png").stat().st_size > 1000


def test_speculative_ratios_and_the_speculative_system_launch():
    import argparse

    import pytest

    from cortexstream.benchmarks.serve import check_args, launch_of
    from cortexstream.benchmarks.serve_processes import command
    from cortexstream.benchmarks.serve_report import SPECULATIVE_SYSTEM, speculative_ratios
    from cortexstream.errors import InvalidArgumentError

    plain = {"output_tokens_per_s": 10.0, "ttft_p50_s": 0.5, "tpot_p50_s": 0.1}
    r = speculative_ratios(dict(plain, output_tokens_per_s=9.0), plain)
    assert r["output_tokens_per_s"] == pytest.approx(0.9) and r["never_slower"] is False
    assert speculative_ratios(dict(plain, output_tokens_per_s=12.0), plain)["never_slower"] is True
    result = {"machine": "m", "model": "m", "seed": 0, "quick": False, "command": "x",
              "workloads": [{"name": "unrelated", "description": "d", "order": ["a"],
                             "systems": {"cortexstream": plain, SPECULATIVE_SYSTEM: plain},
                             "speculative_ratios": speculative_ratios(plain, plain)}]}
    result["workloads"][0]["systems"] = {k: dict(v, request_throughput=1.0, ttft_p99_s=1.0, tpot_p99_s=1.0,
                                                 peak_rss_mib=1.0, failed=0)
                                         for k, v in result["workloads"][0]["systems"].items()}
    assert "speculation on vs off" in markdown(result) and "target >= 1.0x: met" in markdown(result)
    args = argparse.Namespace(systems=f"cortexstream,{SPECULATIVE_SYSTEM}", workloads="unrelated",
                              speculative="ngram:k=3,n=2", kv_tokens=512, max_num_seqs=4)
    launch = launch_of(SPECULATIVE_SYSTEM, args)
    assert launch.system == "cortexstream" and "speculative ngram:k=3,n=2" in launch.label
    cmd = command(launch, "/m", 1234)
    assert cmd[cmd.index("--speculative") + 1] == "ngram:k=3,n=2"
    assert "--speculative" not in command(launch_of("cortexstream", args), "/m", 1234)
    with pytest.raises(InvalidArgumentError, match="speculative"):
        check_args(argparse.Namespace(**{**vars(args), "speculative": "ngram:k=zero"}))


def test_a_budgeted_launch_passes_max_memory_instead_of_kv_tokens():
    import pytest

    from cortexstream.benchmarks.serve_processes import Launch, command

    cmd = command(Launch("cortexstream", None, 4, max_memory="1.5GiB"), "/m", 1234)
    assert cmd[cmd.index("--max-memory") + 1] == "1.5GiB" and "--kv-tokens" not in cmd
    with pytest.raises(ValueError, match="max_memory"):
        Launch("cortexstream", 2048, 4, max_memory="1.5GiB")
    with pytest.raises(ValueError, match="max_memory"):
        Launch("mlx_lm", None, 4, max_memory="1.5GiB")
