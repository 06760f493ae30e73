"""Two ranks on this machine (ring backend over 127.0.0.1): the model split tensor-parallel, rank 0 scheduling.

- the tokens two ranks generate are the tokens one process generates (one stream, concurrent requests), through
  `mlx.launch` and through the `cortexstream generate` command;
- every rank samples the same tokens, seeded or not, with a position-based KV policy and under a grammar; each
  rank's arena holds half the KV heads;
- an idle rank 0 keeps the others waiting past the timeout (heartbeats);
- a rank that is killed or stopped (SIGSTOP: it hangs) ends the other with an error naming it, within the timeout;
- `cortexstream serve` on two ranks answers, idles past the timeout, and both ranks stop with it (SIGTERM);
- under `serve`, a request naming a KV policy the ranks cannot share gets a 400 naming `kv_policy`, one with a
  per-head policy runs, a repeated prompt is served from the prefix cache and `n` forks seeded completions; a rank that
  dies or hangs turns /health and every new or in-flight request into a 503 with the reason, then rank 0 exits 1;
- a soak of 30 requests with preemption and aborts leaves both ranks with the same block-operation digest;
- what cannot be split or shared is refused with the reason (tests/test_distributed_parts.py).

The ranks run tests/distributed_rank.py as separate processes (started directly with MLX_RANK / MLX_HOSTFILE, as
mlx.launch starts them, so a test can kill one). Skipped when the ring backend cannot connect two local processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cortexstream.distributed.local_ranks import free_port_pair, rank_environment, write_local_hostfile
from tiny_models import TINY_CONFIG, varied_tiny_model, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
RANK = str(ROOT / "tests" / "distributed_rank.py")
LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
TIMEOUT = 5.0  # the ranks' --rank-timeout in these tests
START = 40.0  # seconds two ranks may take to start, load and finish a short scenario


def start_ranks(folder: Path, *args: str, program: str = sys.executable) -> list[subprocess.Popen]:
    """`program args` as ranks 0 and 1, started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE)."""
    hostfile = write_local_hostfile(folder)
    return [subprocess.Popen([program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=rank_environment(rank, hostfile))
            for rank in range(2)]


def finish(procs: list[subprocess.Popen], within: float) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; kills them all if they take longer than `within` seconds."""
    deadline = time.monotonic() + within
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"the ranks did not end within {within:g} s")
        results.append((proc.returncode, err))
    return results


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> Path:
    """A folder for this module's files, once two local processes have all-summed over the ring backend."""
    folder = tmp_path_factory.mktemp("ranks")
    code = ("import mlx.core as mx; g = mx.distributed.init(backend='ring', strict=True); "
            "print(mx.distributed.all_sum(mx.array([g.rank() + 1]), group=g).item())")
    procs = start_ranks(folder, "-c", code)
    try:
        outs = [proc.communicate(timeout=30) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.skip("the ring backend did not connect two local processes within 30 s")
    if any(proc.returncode != 0 or out.strip() != "3" for proc, (out, _) in zip(procs, outs)):
        pytest.skip(f"the ring backend cannot start here: {outs[0][1].strip()[-300:]}")
    return folder


@pytest.fixture(scope="module")
def split_model(ring) -> str:
    """A tiny model whose heads split over 2 ranks (4 query, 2 KV), its layers scaled so that its greedy tokens
    vary (the plain tiny model repeats its last prompt token, which a broken attention would too)."""
    model = varied_tiny_model(seed=7)
    path = str(ring / "split.gguf")
    write_tiny_gguf(path, model)
    return path


@pytest.fixture(scope="module")
def reference(split_model, ring) -> dict:
    """What one process without ranks generates."""
    out = ring / "local.json"
    subprocess.run([sys.executable, RANK, split_model, "local", str(out)], check=True, timeout=START)
    return json.loads(out.read_text())


def run_ranks(ring: Path, model: str, scenario: str, *extra: str) -> tuple[dict, dict]:
    out = ring / f"{scenario.replace(',', '-')}.json"
    procs = start_ranks(ring, RANK, model, scenario, str(out), str(TIMEOUT), *extra)
    results = finish(procs, START)
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    return json.loads(out.read_text()), json.loads(Path(f"{out}.rank1").read_text())


def assert_rank_tokens(rank0: list[list[int]], rank1: dict[str, list[int]]) -> None:
    """Rank 1 sampled each request's tokens as rank 0 emitted them (plus at most one launched after the last)."""
    ordered = [rank1[rid] for rid in sorted(rank1, key=lambda rid: int(rid.rsplit("-", 1)[1]))]
    assert len(ordered) == len(rank0)
    for mine, theirs in zip(ordered, rank0):
        assert mine[: len(theirs)] == theirs and len(mine) - len(theirs) in (0, 1)


def test_two_ranks_generate_what_one_process_generates_through_mlx_launch(ring, split_model, reference):
    out = ring / "launched.json"
    port = free_port_pair()
    proc = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(port), "--",
                           sys.executable, RANK, split_model, "single,batch", str(out), str(TIMEOUT)],
                          capture_output=True, text=True, timeout=START)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["single"] == reference["single"] and len(set(result["single"])) > 5
    assert result["batch"] == reference["batch"]
    assert result["kv_heads"] == 1  # 2 KV heads split over 2 ranks: each arena holds one
    # Attention, MLP, the embedding table (tied to the output head) split: each rank keeps about half the weights.
    # Only the norms stay whole on both ranks (2 per layer and the final one, float32).
    kept = [result["param_bytes"], json.loads(Path(f"{out}.rank1.footprint").read_text())["param_bytes"]]
    norms = (2 * TINY_CONFIG["num_hidden_layers"] + 1) * TINY_CONFIG["hidden_size"] * 4
    assert sum(kept) == reference["param_bytes"] + norms, (kept, reference["param_bytes"])
    assert all(abs(k / reference["param_bytes"] - 0.5) < 0.01 for k in kept), (kept, reference["param_bytes"])


def test_every_rank_samples_the_same_tokens_seeded_or_not(ring, split_model):
    rank0, rank1 = run_ranks(ring, split_model, "sampled")
    assert_rank_tokens(rank0["seeded"] + rank0["unseeded"], rank1)
    again, _ = run_ranks(ring, split_model, "sampled")
    assert again["seeded"] == rank0["seeded"]  # a seed gives the same tokens on every run


def test_a_position_based_policy_and_a_grammar_give_the_same_tokens_on_every_rank(ring, split_model):
    # Not compared with one process: where a streaming policy evicts depends on how the prompt was chunked, and
    # the adaptive prefill budget chunks by measured time (two runs of one process differ too).
    rank0, rank1 = run_ranks(ring, split_model, "streaming,grammar")
    assert_rank_tokens(rank0["streaming"] + rank0["grammar"], rank1)
    assert all(text.startswith("{") for text in rank0["grammar_texts"])


def test_an_idle_rank_0_keeps_the_others_waiting_past_the_timeout(ring, split_model):
    rank0, _ = run_ranks(ring, split_model, "idle", str(2.5 * TIMEOUT))
    assert rank0["idle"][0] == rank0["idle"][1]


def _start_long(ring: Path, model: str, name: str) -> list[subprocess.Popen]:
    out = ring / f"{name}.json"
    procs = start_ranks(ring, RANK, model, "long", str(out), str(TIMEOUT))
    deadline = time.monotonic() + START
    while not Path(f"{out}.started").exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for proc in procs:
                proc.kill()
            pytest.fail("the ranks did not start generating: " + "".join(p.communicate()[1][-1000:] for p in procs))
        time.sleep(0.1)
    return procs


@pytest.mark.parametrize("victim, how", [(1, signal.SIGKILL), (1, signal.SIGSTOP), (0, signal.SIGKILL),
                                         (0, signal.SIGSTOP)], ids=["rank1-killed", "rank1-hangs", "rank0-killed",
                                                                    "rank0-hangs"])
def test_a_rank_that_dies_or_hangs_ends_the_other_with_an_error_within_the_timeout(ring, split_model, victim, how):
    procs = _start_long(ring, split_model, f"long-{victim}-{how.name}")
    survivor = procs[1 - victim]
    os.kill(procs[victim].pid, how)
    tic = time.monotonic()
    try:
        _, err = survivor.communicate(timeout=TIMEOUT + 15)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"rank {1 - victim} still runs {TIMEOUT + 15:g} s after rank {victim} got {how.name}")
    finally:
        procs[victim].kill()
        procs[victim].communicate()
    assert survivor.returncode != 0
    assert time.monotonic() - tic < TIMEOUT + 15
    assert f"rank {victim}" in err, err[-2000:]


def test_cortexstream_generate_under_mlx_launch_prints_what_one_process_prints(ring, split_model):
    command = [str(Path(sys.executable).parent / "cortexstream"), "generate", "--model", split_model, "-p",
               "hello world", "-m", "16", "--no-chat-template", "--rank-timeout", str(TIMEOUT)]
    alone = subprocess.run(command, capture_output=True, timeout=START)
    port = free_port_pair()
    launched = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(port), "--",
                               *command], capture_output=True, timeout=START)
    assert alone.returncode == 0 and launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout and len(alone.stdout) > 16  # rank 1 printed nothing


def http(port: int, path: str, body: dict | None = None, timeout: float = 20) -> tuple[int, dict]:
    """(status, JSON body) of a GET (no body) or POST to the local server; error statuses are returned too."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def start_server(ring: Path, model: str, *extra: str) -> tuple[list[subprocess.Popen], int, dict]:
    """`cortexstream serve` on two ranks (`extra`: more serve options), once it answered a first completion:
    (processes, port, that answer)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    procs = start_ranks(ring, "serve", "--model", model, "--port", str(http_port), "--kv-tokens", "1024",
                        "--rank-timeout", str(TIMEOUT), *extra,
                        program=str(Path(sys.executable).parent / "cortexstream"))
    deadline = time.monotonic() + START
    while True:
        try:
            status, answer = http(http_port, "/v1/completions", {"prompt": "hello world", "max_tokens": 8,
                                                                 "temperature": 0})
            assert status == 200, answer
            return procs, http_port, answer
        except OSError:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for proc in procs:
                    proc.kill()
                pytest.fail("the server did not answer: " + "".join(p.communicate()[1][-1500:] for p in procs))
            time.sleep(0.5)


def test_cortexstream_serve_on_two_ranks_answers_and_both_ranks_stop_with_it(ring, split_model):
    procs, http_port, answer = start_server(ring, split_model)
    try:
        assert answer["usage"]["completion_tokens"] == 8
        # A request naming a KV policy the ranks cannot share is refused alone, naming the field; one that selects
        # per KV head runs.
        status, refused = http(http_port, "/v1/completions", {"prompt": "hello", "max_tokens": 4,
                                                              "kv_policy": "sidecar"})
        assert status == 400 and refused["error"]["param"] == "kv_policy", refused
        assert "merges_per_head" in refused["error"]["message"]
        long = "the cat sat on the mat and then " * 4  # 100+ tokens: whole blocks for the prefix cache
        status, evicting = http(http_port, "/v1/completions", {"prompt": long, "max_tokens": 8, "temperature": 0,
                                                               "kv_policy": "h2o:budget=16,sinks=2"})
        assert status == 200 and evicting["usage"]["completion_tokens"] == 8, evicting
        # The same prompt twice: the second is served from rank 0's prefix cache, with the same text.
        first, second = (http(http_port, "/v1/completions", {"prompt": long, "max_tokens": 8, "temperature": 0})
                         for _ in range(2))
        assert first[0] == second[0] == 200 and first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]
        assert second[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, second
        # n > 1: three seeded completions forked from one prompt, the same on a second request.
        forked = [http(http_port, "/v1/completions", {"prompt": long, "max_tokens": 8, "n": 3, "temperature": 0.9,
                                                      "seed": 5}) for _ in range(2)]
        assert forked[0][0] == forked[1][0] == 200 and len(forked[0][1]["choices"]) == 3, forked[0]
        assert [c["text"] for c in forked[0][1]["choices"]] == [c["text"] for c in forked[1][1]["choices"]]
        status, again = http(http_port, "/v1/completions", {"prompt": "hello world", "max_tokens": 8,
                                                            "temperature": 0})
        assert status == 200 and again["choices"][0]["text"] == answer["choices"][0]["text"]
        time.sleep(1.5 * TIMEOUT)  # idle past the timeout: heartbeats keep rank 1 waiting
        assert procs[1].poll() is None
        procs[0].send_signal(signal.SIGTERM)
        results = finish(procs, 30)
    finally:
        for proc in procs:
            proc.kill()
    assert [code for code, _ in results] == [0, 0], [err[-1500:] for _, err in results]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["rank1-killed", "rank1-hangs"])
def test_serve_answers_503_with_the_reason_when_a_rank_dies_then_exits(ring, split_model, how):
    import threading

    procs, http_port, _ = start_server(ring, split_model)
    try:
        in_flight: list[tuple[int, dict]] = []
        long = threading.Thread(target=lambda: in_flight.append(http(
            http_port, "/v1/completions", {"prompt": "hello world", "max_tokens": 900, "temperature": 0},
            timeout=TIMEOUT + 15)))
        long.start()
        time.sleep(0.3)  # the long request is generating
        os.kill(procs[1].pid, how)
        tic = time.monotonic()
        # A dead rank closes its connection (found at once); a hung one is found when it leaves a message
        # unanswered for the timeout.
        within = 2.0 if how is signal.SIGKILL else TIMEOUT + 3
        health = None
        while time.monotonic() - tic < within + 5:
            code, health = http(http_port, "/health", timeout=5)
            if code != 200:
                break
            time.sleep(0.1)
        assert code == 503 and health["status"] == "failed" and "rank 1" in health["reason"], health
        status, refused = http(http_port, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert status == 503 and "rank 1" in refused["error"]["message"], refused
        assert time.monotonic() - tic < within
        long.join(TIMEOUT + 15)
        assert in_flight and in_flight[0][0] == 503 and "rank 1" in in_flight[0][1]["error"]["message"], in_flight
        code, err = finish(procs[:1], TIMEOUT + 15)[0]
    finally:
        for proc in procs:
            proc.kill()
    assert code == 1 and "rank 1" in err, err[-1500:]


def test_soak_two_ranks_keep_the_same_block_tables_under_preemption_and_aborts(ring, split_model):
    out = ring / "soak-local.json"
    subprocess.run([sys.executable, RANK, split_model, "local:soak", str(out)], check=True, timeout=START)
    alone = json.loads(out.read_text())
    tic = time.monotonic()
    rank0, rank1 = run_ranks(ring, split_model, "soak")
    assert time.monotonic() - tic < 90
    assert rank0["soak_preemptions"] > 0 and alone["soak_preemptions"] > 0  # the small arena forced preemption
    finish_reasons = rank0["soak_finish"]
    assert finish_reasons.count("aborted") == 4 and finish_reasons.count(None) == 0, finish_reasons
    for mine, theirs, why in zip(rank0["soak"], alone["soak"], finish_reasons):
        if why != "aborted":  # every completed request: one process's greedy tokens
            assert mine == theirs
    digests = rank0["digests"]
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"]  # same block operations on both ranks
