"""Two ranks on this machine over MLX's mpi backend, started by `mpirun` (Open MPI) without mlx.launch:

- the backend follows the launcher (mpirun: mpi) unless --rank-backend / CORTEXSTREAM_RANK_BACKEND names one; an
  unknown or never verified backend is refused with the flag or variable named;
- rank 0's control address reaches the other rank without a hostfile (rank 0 announces it over the group);
- the tokens two ranks generate are one process's (one stream, four concurrent requests), rank 1 samples the same
  tokens and both ranks end with the same block-operation digest; `cortexstream generate` under mpirun prints what
  one process prints;
- a rank that hangs (SIGSTOP) or dies (SIGKILL) ends the run with an error naming it within the timeout;
- `cortexstream serve` under mpirun answers, and SIGTERM to rank 0 stops both ranks with mpirun's status 0 (each
  rank finalized MPI, mpi_finalize.py).

The ranks run tests/distributed_rank.py as tests/test_distributed.py runs them over the ring backend. The mpirun
tests are skipped when `mpirun` is absent or MLX's mpi backend cannot all-sum over two local processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cortexstream.cli.distributed import check_rank_args
from cortexstream.distributed import DistributedError, RankBackend, launched
from cortexstream.distributed.backends import choose_backend
from cortexstream.distributed.control_address import ControlAddress, listen_address, machine_id
from cortexstream.errors import InvalidArgumentError
from tiny_models import varied_tiny_model, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
RANK = str(ROOT / "tests" / "distributed_rank.py")
CLI = str(Path(sys.executable).parent / "cortexstream")
MPIRUN = shutil.which("mpirun")
TIMEOUT = 5.0  # the ranks' --rank-timeout
START = 40.0  # seconds two ranks may take to start, load and finish a short scenario
LAUNCH_VARIABLES = ("MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                    "CORTEXSTREAM_RANK_BACKEND", "CORTEXSTREAM_CONTROL_HOST", "MLX_JACCL_COORDINATOR", "NCCL_HOST_IP")
# `python -c PID_WRAPPER BASE PROGRAM ARGS...` writes this rank's pid to BASE.pid<rank>, then becomes PROGRAM (exec
# keeps the pid): mpirun starts the ranks, and a test signals one of them.
PID_WRAPPER = ("import os, sys; open(sys.argv[1] + '.pid' + os.environ['OMPI_COMM_WORLD_RANK'], 'w')"
               ".write(str(os.getpid())); os.execv(sys.argv[2], sys.argv[2:])")


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher's variables: each test sets what it needs."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_an_mpi_launch_is_detected_and_chooses_the_mpi_backend(bare_env):
    assert not launched() and choose_backend().backend is RankBackend.RING  # no launcher: ring, alone
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "1")
    bare_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert not launched()  # mpirun -np 1: runs alone
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert launched() and choose_backend().backend is RankBackend.MPI
    assert "OMPI_COMM_WORLD_SIZE" in choose_backend().source
    assert choose_backend("ring").backend is RankBackend.RING  # the user's choice wins
    bare_env.setenv("CORTEXSTREAM_RANK_BACKEND", "ring")
    assert choose_backend().backend is RankBackend.RING
    for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "CORTEXSTREAM_RANK_BACKEND"):
        bare_env.delenv(name)
    bare_env.setenv("PMI_SIZE", "3")  # an MPICH-style launcher
    bare_env.setenv("PMI_RANK", "2")
    assert launched() and choose_backend().backend is RankBackend.MPI


def _args(backend: str | None) -> object:
    import argparse

    return argparse.Namespace(rank_timeout=5.0, rank_backend=backend)


def test_an_unknown_or_unverified_backend_is_refused_naming_the_flag(bare_env):
    check_rank_args(_args("mpi"))
    check_rank_args(_args("ring"))
    with pytest.raises(InvalidArgumentError, match=r"--rank-backend: 'rings' is not a backend \(one of ring, mpi"):
        check_rank_args(_args("rings"))
    with pytest.raises(InvalidArgumentError, match="--rank-backend: backend 'jaccl' is not supported yet: it needs "
                                                   r"RDMA over Thunderbolt.*\(verified: ring, mpi\)"):
        check_rank_args(_args("jaccl"))
    bare_env.setenv("CORTEXSTREAM_RANK_BACKEND", "bogus")
    with pytest.raises(InvalidArgumentError, match="CORTEXSTREAM_RANK_BACKEND: 'bogus' is not a backend"):
        check_rank_args(_args(None))
    bare_env.delenv("CORTEXSTREAM_RANK_BACKEND")
    bare_env.setenv("MLX_RANK", "0")  # mlx.launch --backend jaccl
    bare_env.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:32323")
    with pytest.raises(InvalidArgumentError, match=r"mlx.launch \(MLX_JACCL_COORDINATOR\): backend 'jaccl' is not"):
        check_rank_args(_args(None))


def test_the_cli_refuses_an_unknown_backend_before_loading_the_model(bare_env):
    out = subprocess.run([CLI, "generate", "--model", "/nonexistent.gguf", "-p", "hi", "--rank-backend", "tcp"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--rank-backend: 'tcp' is not a backend" in out.stderr, out.stderr[-1000:]


def test_the_control_address_travels_as_numbers_and_same_machine_ranks_try_loopback_first(bare_env):
    address = ControlAddress(40123, ("192.0.2.7", "10.1.2.3"), True, machine_id())
    assert ControlAddress.from_ints(address.to_ints()) == address
    assert address.targets(machine_id()) == ("127.0.0.1", "192.0.2.7", "10.1.2.3")
    assert address.targets(machine_id() + 1) == ("192.0.2.7", "10.1.2.3")  # another machine: no loopback
    with pytest.raises(DistributedError, match="addresses"):
        ControlAddress(40123, (), False, 0)
    assert listen_address()[0] == "0.0.0.0"  # no hostfile, nothing named: every interface
    bare_env.setenv("CORTEXSTREAM_CONTROL_HOST", "127.0.0.1")
    assert listen_address() == ("127.0.0.1", ("127.0.0.1",))
    bare_env.setenv("CORTEXSTREAM_CONTROL_HOST", "not a host name")  # refused by the resolver, no DNS query
    with pytest.raises(DistributedError, match="CORTEXSTREAM_CONTROL_HOST: 'not a host name'"):
        listen_address()


# Containers often forbid the cross-process copy (CMA) Open MPI 4's shared-memory transport uses for large
# messages; copying through the shared segment instead works everywhere.
MPI_ENV = {"OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


def mpirun(*command: str, env: dict[str, str] | None = None) -> list[str]:
    """`command` as ranks 0 and 1 on this machine, each `env` variable exported to them."""
    exports = [arg for name in (env or {}) for arg in ("-x", name)]
    return [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", *exports, *command]


def run(command: list[str], env: dict[str, str] | None = None, within: float = START) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=within, stdin=subprocess.DEVNULL,
                          env={**os.environ, **MPI_ENV, **(env or {})})


@pytest.fixture(scope="module")
def ranks_folder(tmp_path_factory) -> Path:
    """A folder for this module's files, once two processes started by mpirun have all-summed over MLX's mpi."""
    if MPIRUN is None:
        pytest.skip("mpirun is not installed (Open MPI: apt-get install openmpi-bin libopenmpi-dev)")
    code = ("import mlx.core as mx; g = mx.distributed.init(backend='mpi', strict=True); "
            "total = mx.distributed.all_sum(mx.array([g.rank() + 1]), group=g).item(); "
            "print(total) if g.rank() == 0 else None")  # one rank prints: mpirun may interleave two ranks' lines
    try:
        out = run(mpirun(sys.executable, "-c", code), within=30)
    except subprocess.TimeoutExpired:
        pytest.skip("MLX's mpi backend did not connect two local processes within 30 s")
    if out.returncode != 0 or out.stdout.split() != ["3"]:
        pytest.skip(f"MLX's mpi backend cannot start here: {(out.stdout + out.stderr).strip()[-300:]}")
    return tmp_path_factory.mktemp("mpi-ranks")


@pytest.fixture(scope="module")
def split_model(ranks_folder) -> str:
    """The tiny model of tests/test_distributed.py: heads that split over 2 ranks (4 query, 2 KV), layers scaled
    so that its greedy tokens vary."""
    model = varied_tiny_model(seed=7)
    path = str(ranks_folder / "split.gguf")
    write_tiny_gguf(path, model)
    return path


@pytest.fixture(scope="module")
def reference(split_model, ranks_folder) -> dict:
    """What one process without ranks generates."""
    out = ranks_folder / "local.json"
    subprocess.run([sys.executable, RANK, split_model, "local", str(out)], check=True, timeout=START)
    return json.loads(out.read_text())


def test_two_mpi_ranks_generate_what_one_process_generates(ranks_folder, split_model, reference):
    out = ranks_folder / "single-batch.json"
    proc = run(mpirun(sys.executable, RANK, split_model, "single,batch", str(out), str(TIMEOUT)))
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    rank0, rank1 = json.loads(out.read_text()), json.loads(Path(f"{out}.rank1").read_text())
    assert rank0["single"] == reference["single"] and len(set(rank0["single"])) > 5
    assert rank0["batch"] == reference["batch"]
    assert rank0["kv_heads"] == 1  # 2 KV heads split over 2 ranks: each arena holds one
    assert rank0["digests"]["0"] == rank0["digests"]["1"]
    # Rank 1 sampled every request's tokens as rank 0 emitted them (plus at most one launched after the last).
    ordered = [rank1[rid] for rid in sorted(rank1, key=lambda rid: int(rid.rsplit("-", 1)[1]))]
    assert len(ordered) == 1 + len(rank0["batch"])
    for mine, theirs in zip(ordered, [rank0["single"], *rank0["batch"]]):
        assert mine[: len(theirs)] == theirs and len(mine) - len(theirs) in (0, 1)


def test_cortexstream_generate_under_mpirun_prints_what_one_process_prints(ranks_folder, split_model):
    command = [CLI, "generate", "--model", split_model, "-p", "hello world", "-m", "16", "--no-chat-template",
               "--rank-timeout", str(TIMEOUT)]
    alone = run(command)
    # The backend named by the flag, and rank 0's control channel on a named address.
    launched_run = run(mpirun(*command, "--rank-backend", "mpi", env={"CORTEXSTREAM_CONTROL_HOST": "127.0.0.1"}),
                       env={"CORTEXSTREAM_CONTROL_HOST": "127.0.0.1"})
    assert alone.returncode == 0 and launched_run.returncode == 0, launched_run.stderr[-2000:]
    assert launched_run.stdout == alone.stdout and len(alone.stdout) > 16  # rank 1 printed nothing
    # The ring backend named under mpirun: refused with what started the process.
    wrong = run(mpirun(*command, "--rank-backend", "ring"))
    assert wrong.returncode != 0 and "mpirun (OMPI_COMM_WORLD_SIZE)" in wrong.stderr, wrong.stderr[-2000:]


def start_with_pids(base: Path, *command: str) -> subprocess.Popen:
    """mpirun running `command` as two ranks, each writing its pid to `base`.pid<rank> first."""
    return subprocess.Popen(mpirun(sys.executable, "-c", PID_WRAPPER, str(base), *command), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env={**os.environ, **MPI_ENV})


def wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    """Until `ready()` (within START seconds, while mpirun runs)."""
    deadline = time.monotonic() + START
    while not ready():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"{what}: " + proc.communicate(timeout=10)[1][-1500:])
        time.sleep(0.2)


def rank_pids(base: Path) -> list[int]:
    return [int(Path(f"{base}.pid{rank}").read_text()) for rank in range(2)]


def kill_all(proc: subprocess.Popen, base: Path) -> None:
    """mpirun and both ranks, whatever state they are in."""
    for rank in range(2):
        try:
            os.kill(int(Path(f"{base}.pid{rank}").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # never started, or already gone
    proc.kill()
    proc.communicate()


@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL], ids=["rank1-hangs", "rank1-killed"])
def test_a_rank_that_hangs_or_dies_ends_the_run_with_an_error_naming_it(ranks_folder, split_model, how):
    out = ranks_folder / f"long-{how.name}.json"
    proc = start_with_pids(out, sys.executable, RANK, split_model, "long", str(out), str(TIMEOUT))
    try:
        wait_for(proc, lambda: Path(f"{out}.started").exists() and Path(f"{out}.pid1").exists(),
                 "the ranks did not start generating")
        os.kill(rank_pids(out)[1], how)
        tic = time.monotonic()
        try:
            _, err = proc.communicate(timeout=TIMEOUT + 15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mpirun still runs {TIMEOUT + 15:g} s after rank 1 got {how.name}")
        assert time.monotonic() - tic < TIMEOUT + 15
    finally:
        kill_all(proc, out)
    assert proc.returncode != 0
    if how is signal.SIGSTOP:  # only rank 0's watchdog can find a rank that hangs: its error ends the run
        assert "rank 1 has not answered" in err, err[-2000:]
    else:  # rank 0 finds the closed connection, or mpirun ends it first; either says which rank ended
        assert "rank 1 closed its connection" in err or "rank 1 with PID" in err, err[-2000:]


def test_cortexstream_serve_under_mpirun_answers_and_stops_cleanly_with_rank_0(ranks_folder, split_model):
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = ranks_folder / "serve"
    proc = start_with_pids(base, CLI, "serve", "--model", split_model, "--port", str(port), "--kv-tokens", "1024",
                           "--rank-timeout", str(TIMEOUT))
    answers: list[dict] = []

    def answered() -> bool:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={
            "content-type": "application/json"}, data=json.dumps({"prompt": "hello world", "max_tokens": 8,
                                                                  "temperature": 0}).encode())
        try:
            with urllib.request.urlopen(request, timeout=20) as response:
                answers.append(json.loads(response.read()))
                return True
        except OSError:
            return False

    try:
        wait_for(proc, answered, "the server did not answer")
        assert answers[0]["usage"]["completion_tokens"] == 8
        # SIGTERM to rank 0 alone: it stops the server and the other rank, and both finalize MPI, so mpirun ends
        # with status 0 (a signal to mpirun itself aborts every rank: SIGTERM, then SIGKILL).
        os.kill(rank_pids(base)[0], signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_all(proc, base)
    assert proc.returncode == 0, err[-2000:]
    assert "cortexstream serve: stopped" in err
