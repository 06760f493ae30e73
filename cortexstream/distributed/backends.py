"""Which MLX backend connects the ranks, and whether a launcher started this process as one rank of several.

Launchers leave their mark in the environment:

- `mlx.launch --backend ring` sets `MLX_RANK` and `MLX_HOSTFILE` (a JSON list with one list of "ip:port" per rank;
  empty when there is one rank);
- `mlx.launch --backend jaccl` sets `MLX_RANK` and `MLX_JACCL_COORDINATOR`; `--backend nccl` sets `MLX_RANK` and
  `NCCL_HOST_IP`;
- `mpirun` (Open MPI, which is also what `mlx.launch --backend mpi` runs) sets `OMPI_COMM_WORLD_SIZE` and
  `OMPI_COMM_WORLD_RANK`; MPICH-style launchers (Hydra, Intel MPI, `srun --mpi=pmi2`) set `PMI_SIZE` and `PMI_RANK`.

The backend is the user's when they name it (`--rank-backend`, or the `CORTEXSTREAM_RANK_BACKEND` variable for a
script), else the one the launcher implies, else ring.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass

from cortexstream.distributed.errors import DistributedError

LAUNCH_VARIABLE = "MLX_RANK"
HOSTFILE_VARIABLE = "MLX_HOSTFILE"
BACKEND_VARIABLE = "CORTEXSTREAM_RANK_BACKEND"
BACKEND_FLAG = "--rank-backend"
# (size, rank) variables of the MPI launchers, Open MPI's first.
MPI_VARIABLES = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"))


class RankBackend(str, enum.Enum):
    """MLX's distributed backends (`mx.distributed.init(backend=...)`)."""

    RING = "ring"
    MPI = "mpi"
    JACCL = "jaccl"
    NCCL = "nccl"


# Backends this code was run on (two ranks on one machine's CPU: tests/test_distributed*.py); the others were never
# run and are refused.
VERIFIED_BACKENDS = (RankBackend.RING, RankBackend.MPI)
UNVERIFIED_REASONS = {
    RankBackend.JACCL: "it needs RDMA over Thunderbolt between Macs, which these tests never had",
    RankBackend.NCCL: "it needs CUDA GPUs, which these tests never had",
}


@dataclass(frozen=True)
class BackendChoice:
    """The backend to join the ranks with, and what chose it (named in errors)."""

    backend: RankBackend
    source: str  # "--rank-backend", "CORTEXSTREAM_RANK_BACKEND", a launcher's variable, or "default"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, RankBackend):
            raise DistributedError(f"backend: {self.backend!r} is not a RankBackend")
        if not self.source:
            raise DistributedError("source: say what chose the backend")

    def check_verified(self) -> None:
        """DistributedError naming the flag when this backend was never run with CortexStream."""
        if self.backend in VERIFIED_BACKENDS:
            return
        verified = ", ".join(backend.value for backend in VERIFIED_BACKENDS)
        raise DistributedError(f"{self.source}: backend {self.backend.value!r} is not supported yet: "
                               f"{UNVERIFIED_REASONS[self.backend]} (verified: {verified})")


def parse_backend(value: str | RankBackend, source: str = BACKEND_FLAG) -> RankBackend:
    """`value` as a RankBackend; DistributedError naming `source` (the flag or variable it came from) otherwise."""
    if isinstance(value, RankBackend):
        return value
    try:
        return RankBackend(str(value).strip().lower())
    except ValueError:
        names = ", ".join(backend.value for backend in RankBackend)
        raise DistributedError(f"{source}: {value!r} is not a backend (one of {names})") from None


def mpi_world() -> tuple[int, int, str] | None:
    """(size, rank, size variable) when an MPI launcher started this process, else None."""
    for size_name, rank_name in MPI_VARIABLES:
        size, rank = os.environ.get(size_name), os.environ.get(rank_name)
        if size is not None and rank is not None:
            try:
                return int(size), int(rank), size_name
            except ValueError:
                raise DistributedError(f"{size_name}={size!r}, {rank_name}={rank!r}: not numbers") from None
    return None


def launcher_choice() -> BackendChoice | None:
    """The backend the launcher of this process implies (see the module's docstring), None without one."""
    if os.environ.get(LAUNCH_VARIABLE) is not None:
        if os.environ.get(HOSTFILE_VARIABLE):
            return BackendChoice(RankBackend.RING, f"mlx.launch ({HOSTFILE_VARIABLE})")
        if os.environ.get("MLX_JACCL_COORDINATOR"):
            return BackendChoice(RankBackend.JACCL, "mlx.launch (MLX_JACCL_COORDINATOR)")
        if os.environ.get("NCCL_HOST_IP"):
            return BackendChoice(RankBackend.NCCL, "mlx.launch (NCCL_HOST_IP)")
        return None
    world = mpi_world()
    return None if world is None else BackendChoice(RankBackend.MPI, f"mpirun ({world[2]})")


def choose_backend(requested: str | RankBackend | None = None, source: str = BACKEND_FLAG) -> BackendChoice:
    """`requested` (from `source`) when given, else CORTEXSTREAM_RANK_BACKEND when set, else the launcher's
    backend, else ring."""
    if requested is not None:
        return BackendChoice(parse_backend(requested, source), source)
    named = os.environ.get(BACKEND_VARIABLE)
    if named:
        return BackendChoice(parse_backend(named, BACKEND_VARIABLE), BACKEND_VARIABLE)
    return launcher_choice() or BackendChoice(RankBackend.RING, "default")


def launched() -> bool:
    """True when a launcher started this process as one rank of several: mlx.launch set MLX_RANK (with a ring
    hostfile listing more than one rank: with one rank, mlx.launch leaves it empty and the process runs alone), or
    an MPI launcher's world has more than one process."""
    if os.environ.get(LAUNCH_VARIABLE) is None:
        world = mpi_world()
        return world is not None and world[0] > 1
    path = os.environ.get(HOSTFILE_VARIABLE)
    if not path:
        return True  # another backend's launcher: RankGroup.init says what is supported
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return True  # the control address reports the unreadable file
    try:
        return bool(text) and len(json.loads(text)) > 1
    except (ValueError, TypeError):
        return True  # the control address reports the malformed file


__all__ = ["BACKEND_FLAG", "BACKEND_VARIABLE", "BackendChoice", "RankBackend", "VERIFIED_BACKENDS", "choose_backend",
           "launched", "launcher_choice", "parse_backend"]
