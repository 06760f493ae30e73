"""`bench prefix-tier`: the workloads are real text of the sizes asked (turn prompts grow, no two tool outputs
alike), the arena estimate bounds the real prompts, the report's medians and target verdicts come from the rows,
and bad options are refused (naming the flag) before anything is converted or started."""

from __future__ import annotations

import shlex

import pytest

from cortexstream.benchmarks.common import real_text
from cortexstream.benchmarks.prefix_tier import add_arguments
from cortexstream.benchmarks.prefix_tier_agent import launch_for, run_summary
from cortexstream.benchmarks.prefix_tier_report import markdown, summaries
from cortexstream.benchmarks.prefix_tier_settings import (QUICK_AGENT, AgentShape, AgentSystem, Part, from_args,
                                                          from_values)
from cortexstream.benchmarks.prefix_tier_workloads import (DOC_QUESTION, TextSource, agent_workload,
                                                           document_messages, warmup_messages)
from cortexstream.benchmarks.serve_client import RequestRecord, WorkloadRun
from cortexstream.benchmarks.serve_processes import Launch, command
from cortexstream.cli.main import main
from cortexstream.errors import InvalidArgumentError

SHAPE = AgentShape(sessions=3, turns=4, system_tokens=900, tool_tokens=(60, 90), max_tokens=16)


@pytest.fixture(scope="module")
def source_of(tiny):
    tokenizer = tiny[1]
    ids = list(tokenizer.encode(real_text(120_000), add_special_tokens=False))

    def make() -> TextSource:
        return TextSource(tokenizer, ids, "pydoc topics")

    return make


def test_agent_sessions_have_their_own_prompts_growing_turns_and_the_sizes_asked(source_of):
    source = source_of()
    w = agent_workload(source, SHAPE, seed=1)
    sessions = w.spec.sessions
    assert len(sessions) == 3 and all(len(s.turns) == 4 and s.start == 0.0 for s in sessions)
    assert all(t.max_tokens == 16 for s in sessions for t in s.turns)
    assert len({s.system for s in sessions}) == 3
    for system, size in zip((s.system for s in sessions), w.system_tokens):
        assert size == source.count(system) and 0.85 * 900 <= size <= 1.05 * 900
        assert '"name": ' in system and '"description": ' in system  # tool definitions
    outputs = [t.user_text.split("\n", 1)[1].rsplit("\n\n", 1)[0] for s in sessions for t in s.turns]
    assert len(set(outputs)) == len(outputs) == 12
    sizes = [n for per_session in w.tool_tokens for n in per_session]
    assert all(58 <= n <= 92 for n in sizes) and len(set(sizes)) > 1
    for prompts, turns in zip(w.turn_prompt_tokens, (s.turns for s in sessions)):
        # each turn's prompt is the previous one, its reply and the new turn's text
        for before, after, turn in zip(prompts, prompts[1:], turns[1:]):
            assert after >= before + 16 + source.count(turn.user_text)
    assert w.final_tokens == tuple(p[-1] + 16 for p in w.turn_prompt_tokens)
    again = agent_workload(source_of(), SHAPE, seed=1)
    assert [s.system for s in again.spec.sessions] == [s.system for s in sessions]
    assert again.turn_prompt_tokens == w.turn_prompt_tokens


def test_arena_is_a_fraction_of_the_final_total_but_holds_the_largest_session(source_of):
    w = agent_workload(source_of(), SHAPE, seed=0)
    third = w.kv_tokens(1 / 3)
    assert third % 16 == 0 and third >= max(w.final_tokens) + 256
    assert third >= sum(w.final_tokens) / 3 and third < sum(w.final_tokens)
    one = agent_workload(source_of(), AgentShape(sessions=1, turns=2, system_tokens=900, tool_tokens=(60, 90)), 0)
    assert one.kv_tokens(1 / 3) >= one.final_tokens[0] + 256  # a third of one session would not admit it


def test_turn_estimate_bounds_the_templated_conversation(smollm):
    """With every reply max_tokens long, the real chat-templated prompt of each turn is no longer than estimated."""
    tokenizer = smollm[1]
    source = TextSource(tokenizer, tokenizer.encode(real_text(60_000), add_special_tokens=False), "pydoc")
    w = agent_workload(source, SHAPE, seed=2)
    reply = source.take(16)
    session = w.spec.sessions[0]
    messages = [{"role": "system", "content": session.system}]
    for turn, estimate in zip(session.turns, w.turn_prompt_tokens[0]):
        messages.append({"role": "user", "content": turn.user_text})
        real = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        assert real <= estimate <= real + 60
        messages.append({"role": "assistant", "content": reply})


def test_documents_differ_and_share_nothing_with_the_warm_up(source_of):
    source = source_of()
    a, b = (document_messages(source, 500)[0]["content"] for _ in range(2))
    assert a != b and 480 <= source.count(a) - source.count(b) + 500 <= 520
    body = a.removeprefix("Read this document.\n\n").removesuffix("\n\n" + DOC_QUESTION)
    assert a.endswith(DOC_QUESTION) and 495 <= source.count(body) <= 505 and body not in b
    assert warmup_messages(0) != warmup_messages(1) and warmup_messages(0)[0]["role"] == "system"
    with pytest.raises(InvalidArgumentError, match="text: "):
        source.take(10**7)


def _restart_row(index: int, cold: float, after: float) -> dict:
    return {"round": index, "kv_tokens": 3072,
            "cold": {"ttft_s": cold, "prompt_tokens": 1040, "cached_tokens": 0, "text": "x"},
            "warm": {"ttft_s": 0.05, "prompt_tokens": 1040, "cached_tokens": 1024, "text": "x"},
            "after_restart": {"ttft_s": after, "prompt_tokens": 1040, "cached_tokens": 1024, "text": "x"},
            "first_server": {"exit_code": 0, "stop_seconds": 0.5, "disk_before_stop": {"puts": 65}},
            "second_server": {"blocks_at_start": 65, "index_seconds": 0.01, "corrupt_skipped": 0,
                              "request": {"restored_tokens": 1024, "recomputed_tokens": 16, "restored_blocks": 64,
                                          "hit_blocks": 64, "failed_blocks": 0, "restore_seconds": 0.02}},
            "same_output": True}


def _agent_row(index: int, system: AgentSystem, mean: float, tps: float, rss: float, failed: int = 0) -> dict:
    row = {"round": index, "position": 0, "system": system.value, "kv_tokens": 4096, "ttft_mean_s": mean,
           "ttft_p50_s": mean, "ttft_p95_s": 2 * mean, "output_tokens_per_s": tps, "peak_rss_mib": rss, "wall_s": 9.0,
           "expected": 6, "completed": 6 - failed, "failed": failed}
    if system is AgentSystem.CORTEXSTREAM_DISK:
        row.update(disk={"restored_blocks": 7, "restored_tokens": 112, "hit_blocks": 7, "failed_blocks": 0,
                         "restore_seconds": 0.1, "puts": 40, "evicted_blocks": 0}, arena={"preemptions": 3})
    return row


def _results(restart: list, agent: list, quick: bool = False) -> dict:
    data = {"benchmark": "prefix_tier", "machine": {"platform": "Linux-x86_64", "cpu": "cpu", "cpu_count": 2,
                                                     "mlx": "0.0", "blas": "OpenBLAS"},
            "settings": {"model": "smollm2-135m", "command": "cortexstream bench prefix-tier", "quick": quick,
                         "doc_tokens": 1024, "answer_tokens": 8, "agent": {"arena_fraction": 1 / 3},
                         "agent_workload": "2 concurrent sessions x 3 turns", "kv_tokens": 4096,
                         "final_tokens_total": 12000, "text": "Wikipedia"},
            "restart": restart, "agent": agent}
    data["summary"] = summaries(data)
    return data


def test_report_medians_ratios_and_verdicts():
    restart = [_restart_row(0, 2.0, 0.1), _restart_row(1, 3.0, 0.5), _restart_row(2, 2.5, 0.2)]
    agent = [_agent_row(0, AgentSystem.CORTEXSTREAM_DISK, 0.4, 30.0, 500.0),
             _agent_row(0, AgentSystem.MLX_LM, 1.0, 20.0, 600.0),
             _agent_row(0, AgentSystem.CORTEXSTREAM_RAM, 0.8, 25.0, 450.0),
             _agent_row(1, AgentSystem.CORTEXSTREAM_DISK, 0.6, 10.0, 700.0, failed=1),
             _agent_row(1, AgentSystem.MLX_LM, 1.0, 20.0, 600.0)]
    data = _results(restart, agent)
    r = data["summary"]["restart"]
    assert r["cold_ttft_s"] == 2.5 and r["after_restart_ttft_s"] == 0.2 and r["cold_over_after_restart"] == 12.5
    assert r["met"] is True and r["round_ratios"] == [20.0, 6.0, 12.5] and r["restored_tokens"] == 1024
    a = data["summary"]["agent"]
    disk = a["systems"]["cortexstream_disk"]
    assert disk["ttft_mean_s"] == 0.5 and disk["output_tokens_per_s"] == 20.0 and disk["peak_rss_mib"] == 600.0
    assert disk["failed_total"] == 1 and disk["completed_total"] == 11 and disk["runs"] == 2
    t = a["targets"]
    assert t["ttft_mean"]["ratio"] == 0.5 and t["ttft_mean"]["met"] is True
    assert t["output_tokens_per_s"]["ratio"] == 1.0 and t["output_tokens_per_s"]["met"] is False
    assert t["peak_rss"]["ratio"] == 1.0 and t["peak_rss"]["met"] is True and t["all_completed"] is False
    assert a["ratios"]["cortexstream_ram"]["ttft_mean"] == 0.8
    text = markdown(data)
    assert "cold / after restart **12.5x** (target >= 10x: **met**)" in text
    assert "| 1 | 1040 | 3000 | 50 | 500 | 6.0x | 1024 | 16 | 0.020 | 65 | 0 | yes |" in text
    assert "ttft mean 0.50x (target <= 0.5x: **met**)" in text
    assert "output tokens per s 1.00x (target >= 1.3x: **missed**)" in text
    assert "every turn completed: **missed**" in text and "| cortexstream --kv-disk | 2 | 500 |" in text
    assert "| 0 | cortexstream --kv-disk | 7 | 112 | 7 | 0 | 0.1 | 40 | 0 | 3 |" in text
    assert "Rerun: `cortexstream bench prefix-tier`" in text and "not a measurement" not in text


def test_report_of_a_missed_restart_a_server_that_did_not_start_and_a_single_part():
    slow = _restart_row(0, 1.0, 0.5)
    failed = {"round": 0, "position": 1, "system": "mlx_lm", "kv_tokens": None, "error": "exited with 1:\nboom",
              "expected": 6, "completed": 0, "failed": 6}
    data = _results([slow], [_agent_row(0, AgentSystem.CORTEXSTREAM_DISK, 0.4, 30.0, 500.0), failed], quick=True)
    assert data["summary"]["restart"]["met"] is False
    a = data["summary"]["agent"]
    assert a["systems"]["mlx_lm"]["not_started"] == 1 and a["systems"]["mlx_lm"]["ttft_mean_s"] is None
    assert a["targets"]["ttft_mean"]["met"] is None and a["targets"]["all_completed"] is True
    text = markdown(data)
    assert "(target >= 10x: **missed**)" in text and "mlx_lm.server did not start: `boom`" in text
    assert "ttft mean n/a" in text and "not a measurement" in text
    only = _results([], [_agent_row(0, AgentSystem.CORTEXSTREAM_DISK, 0.4, 30.0, 500.0)])
    assert only["summary"]["restart"] is None and "## Restart" not in markdown(only)
    assert "No ratio against mlx_lm.server" in markdown(only)


def test_run_summary_counts_unsent_turns_as_failed():
    run = WorkloadRun(started=0.0, finished=2.0)
    run.records = [RequestRecord(sent=0.0, first_token=0.2, last_token=1.0, output_tokens=10, done=True),
                   RequestRecord(sent=0.0, first_token=0.6, last_token=1.5, output_tokens=10, done=True),
                   RequestRecord(sent=1.0, error="HTTP 500")]
    s = run_summary(run, peak_rss=2**29, expected=6)
    assert s["completed"] == 2 and s["failed"] == 4 and abs(s["ttft_mean_s"] - 0.4) < 1e-12
    assert s["output_tokens_per_s"] == 10.0 and s["peak_rss_mib"] == 512.0


def test_servers_are_launched_as_asked(tmp_path):
    disk, ram, mlx = (launch_for(s, 4096, 8, tmp_path) for s in AgentSystem)
    assert disk.kv_disk is not None and disk.kv_disk.startswith(str(tmp_path)) and ram.kv_disk is None
    assert launch_for(AgentSystem.CORTEXSTREAM_DISK, 4096, 8, tmp_path).kv_disk != disk.kv_disk  # fresh each run
    cmd = command(disk, "model-dir", 8000)
    assert cmd[cmd.index("--kv-disk") + 1] == disk.kv_disk and cmd[cmd.index("--kv-tokens") + 1] == "4096"
    assert "--kv-disk" not in command(ram, "model-dir", 8000) and mlx.system == "mlx_lm" and mlx.max_num_seqs == 8
    assert disk.label != ram.label  # their logs do not overwrite each other
    with pytest.raises(ValueError, match="kv_disk"):
        Launch("mlx_lm", None, 8, kv_disk=str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--parts", "restart,nope"], "--parts: ['nope'] are not among restart, agent"),
    (["--parts", ","], "--parts: [] must name each part at most once, at least one"),
    (["--parts", "agent,agent"], "--parts: ['agent', 'agent'] must name each part at most once, at least one"),
    (["--rounds", "0"], "--rounds: 0 must be an integer >= 1"),
    (["--doc-tokens", "10"], "--doc-tokens: 10 must be an integer >= 64"),
    (["--seed", "-1"], "--seed: -1 must be an integer >= 0"),
    (["--timeout", "0"], "--timeout: 0.0 must be seconds > 0"),
])
def test_bad_options_fail_before_anything_is_converted(tmp_path, capsys, argv, message):
    code = main(["bench", "prefix-tier", *argv, "--model", str(tmp_path / "never-loaded.gguf"), "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == f"cortexstream: error: {message}"
    assert not list(tmp_path.iterdir())  # nothing written, nothing converted


def test_quick_sizes_and_the_rerun_command_parse_back():
    import argparse

    quick = from_values(quick=True)
    assert quick.rounds == 1 and quick.doc_tokens == 1024 and quick.agent == QUICK_AGENT and quick.name.endswith(
        "_quick")
    assert (QUICK_AGENT.sessions, QUICK_AGENT.turns) == (2, 3) and from_values(quick=False).agent.sessions == 8
    assert quick.command(None) == "cortexstream bench prefix-tier --quick"
    custom = from_values(quick=False, parts="agent", rounds=5, seed=3, timeout=90.5)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = shlex.split(custom.command("smollm2-135m"))
    assert words[:3] == ["cortexstream", "bench", "prefix-tier"]
    assert from_args(parser.parse_args(words[3:])) == custom and custom.parts == (Part.AGENT,)
