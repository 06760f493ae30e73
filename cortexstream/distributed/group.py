"""Which rank this process is and the MLX group of all ranks.

A launcher starts one process per rank (backends.py says which launchers are recognised and how the backend is
chosen); `mx.distributed.init` then connects them, and the group's size is the number of ranks. Where rank 0's
control channel listens is control_address.py's concern.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from cortexstream.distributed.backends import (BACKEND_FLAG, HOSTFILE_VARIABLE, LAUNCH_VARIABLE, VERIFIED_BACKENDS,
                                               BackendChoice, RankBackend, choose_backend, launched, launcher_choice)
from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.mpi_finalize import LIBRARY_VARIABLE as MPI_LIBRARY_VARIABLE
from cortexstream.distributed.mpi_finalize import take_over


@dataclass(frozen=True)
class RankGroup:
    """This process's rank among `size` ranks, and the MLX group the sharded model's collectives run on."""

    rank: int
    size: int
    group: Any  # mx.distributed.Group

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise DistributedError(f"rank {self.rank} of {self.size}: not a rank of the group")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def init(cls, backend: str | RankBackend | BackendChoice | None = None) -> "RankGroup":
        """Join the ranks the launcher started over `backend` (None: choose_backend's rule). Raises
        DistributedError for a backend that was never verified, or when the backend cannot connect them."""
        choice = backend if isinstance(backend, BackendChoice) else choose_backend(backend, "backend")
        choice.check_verified()
        try:
            group = mx.distributed.init(backend=choice.backend.value, strict=True)
        except Exception as exc:  # noqa: BLE001 - MLX raises RuntimeError/ValueError with its own reason
            raise DistributedError(f"mx.distributed.init(backend={choice.backend.value!r}) failed (backend from "
                                   f"{choice.source}): {exc}{_hint(choice)}") from exc
        if choice.backend is RankBackend.MPI:
            take_over(group)  # this rank calls MPI_Finalize itself, after a clean session (mpi_finalize.py)
        return cls(group.rank(), group.size(), group)

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank (the others pass as many zeros): an all-sum over the group."""
        mine = mx.array(values if self.is_leader else [0] * len(values), dtype=mx.int64)
        total = mx.distributed.all_sum(mine, group=self.group)
        mx.eval(total)
        return [int(v) for v in total.tolist()]


def _hint(choice: BackendChoice) -> str:
    """What to check when `choice` could not connect the ranks."""
    launcher = launcher_choice()
    if launcher is not None and launcher.backend is not choice.backend:
        return (f" (this process was started by {launcher.source}, which starts ranks for the "
                f"{launcher.backend.value!r} backend: pass {BACKEND_FLAG} {launcher.backend.value} or leave it out)")
    if choice.backend is RankBackend.MPI and not os.environ.get(MPI_LIBRARY_VARIABLE):
        return (" (MLX's mpi backend loads Open MPI's libmpi.so, which its development package installs "
                "(Debian/Ubuntu: libopenmpi-dev); or name the library: "
                f"mpirun -x {MPI_LIBRARY_VARIABLE}=libmpi.so.40 ...)")
    return ""


__all__ = ["HOSTFILE_VARIABLE", "LAUNCH_VARIABLE", "RankGroup", "VERIFIED_BACKENDS", "launched"]
