"""What `bench throughput` does when a launcher (mlx.launch, mpirun) started it as one of several ranks, up to
joining them: it goes on to load its model (it runs there, our engine's rows only), refuses an unverified
--rank-backend before the model loads, and the library call `throughput.run` without the ranks' session is refused
naming `ranks=`. Checked in one process: the launchers' variables are set, no rank is started. The benchmark on
two ranks: tests/test_distributed_bench.py; `generate` and `serve` on ranks: tests/test_distributed.py and
tests/test_distributed_mpi.py."""

from __future__ import annotations

import json

import pytest

from cortexstream.cli.main import main

LAUNCHER_VARIABLES = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "NCCL_HOST_IP", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK")


def as_launched(monkeypatch, tmp_path, launcher: str) -> None:
    """This process's environment as `launcher` leaves it in a rank."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if launcher.startswith("mlx.launch"):
        ranks = 2 if launcher == "mlx.launch" else 1  # with one rank, mlx.launch writes an empty hostfile
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{5000 + i}"] for i in range(ranks)]) if ranks > 1 else "")
        monkeypatch.setenv("MLX_RANK", "1" if ranks > 1 else "0")
        monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    elif launcher == "mpirun":
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")


def bench_throughput(tmp_path) -> list[str]:
    # A model that does not exist: the refusal must come before the model loads.
    return ["bench", "throughput", "--quick", "--model", str(tmp_path / "missing.gguf"), "--out",
            str(tmp_path / "results")]


@pytest.mark.parametrize("launcher", ["mlx.launch", "mpirun"])
def test_bench_throughput_as_one_of_several_ranks_goes_on_to_load_its_model(monkeypatch, tmp_path, capsys, launcher):
    as_launched(monkeypatch, tmp_path, launcher)
    assert main(bench_throughput(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "several ranks" not in err and "missing.gguf" in err, err  # not refused: it got as far as the model
    assert not list((tmp_path / "results").glob("throughput*"))  # nothing written


def test_an_unverified_rank_backend_is_refused_before_the_model_loads(monkeypatch, tmp_path, capsys):
    as_launched(monkeypatch, tmp_path, "mlx.launch")
    assert main([*bench_throughput(tmp_path), "--rank-backend", "nccl"]) == 1
    err = capsys.readouterr().err
    assert "--rank-backend" in err and "missing.gguf" not in err, err


@pytest.mark.parametrize("launcher", ["none", "mlx.launch with one rank"])
def test_bench_throughput_alone_goes_on_to_load_its_model(monkeypatch, tmp_path, capsys, launcher):
    as_launched(monkeypatch, tmp_path, launcher)
    assert main(bench_throughput(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "several ranks" not in err and "missing.gguf" in err, err  # it got as far as loading the model


def test_the_library_call_without_the_ranks_session_is_refused(monkeypatch, tmp_path):
    from cortexstream.benchmarks import throughput
    from cortexstream.errors import InvalidArgumentError

    as_launched(monkeypatch, tmp_path, "mpirun")
    with pytest.raises(InvalidArgumentError, match=r"no ranks= \(rank 0's DistributedSession\)"):
        throughput.run(str(tmp_path / "missing.gguf"), str(tmp_path / "results"), throughput.Settings(quick=True))
    assert not (tmp_path / "results").exists()  # refused before anything was written
