"""Which rank this process is, the MLX group of all ranks, and where rank 0 listens.

A process is one rank of several when `mlx.launch` started it: the launcher sets `MLX_RANK` (and, for the ring
backend, `MLX_HOSTFILE`: a JSON list with one list of "ip:port" per rank). `mx.distributed.init` then connects the
ranks; the group's size is the number of ranks. Rank 0's address for the control channel (engine/plan messages,
cortexstream/distributed/control.py) is the IP of the first rank in that hostfile.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from cortexstream.distributed.errors import DistributedError

LAUNCH_VARIABLE = "MLX_RANK"
HOSTFILE_VARIABLE = "MLX_HOSTFILE"
# Backends this code was run on (two ranks on one machine's CPU); the others may work but were never run.
VERIFIED_BACKENDS = ("ring",)


def launched() -> bool:
    """True when this process was started as one rank of several: mlx.launch set MLX_RANK, and its hostfile lists
    more than one rank (with one rank, mlx.launch leaves the hostfile empty: the process runs alone)."""
    if os.environ.get(LAUNCH_VARIABLE) is None:
        return False
    path = os.environ.get(HOSTFILE_VARIABLE)
    if not path:
        return True  # another backend's launcher: RankGroup.init says what is supported
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return True  # leader_host() reports the unreadable file
    try:
        return bool(text) and len(json.loads(text)) > 1
    except (ValueError, TypeError):
        return True  # leader_host() reports the malformed file


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
    def init(cls, backend: str = "ring") -> "RankGroup":
        """Join the ranks mlx.launch started (`backend` as given to mlx.launch). Raises DistributedError when the
        backend cannot connect them."""
        if backend not in VERIFIED_BACKENDS:
            raise DistributedError(f"backend: {backend!r} is not supported yet (verified: {', '.join(VERIFIED_BACKENDS)})")
        try:
            group = mx.distributed.init(backend=backend, strict=True)
        except Exception as exc:  # noqa: BLE001 - MLX raises RuntimeError/ValueError with its own reason
            raise DistributedError(f"mx.distributed.init(backend={backend!r}) failed: {exc}") from exc
        return cls(group.rank(), group.size(), group)

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank (the others pass as many zeros): an all-sum over the group."""
        mine = mx.array(values if self.is_leader else [0] * len(values), dtype=mx.int64)
        total = mx.distributed.all_sum(mine, group=self.group)
        mx.eval(total)
        return [int(v) for v in total.tolist()]


def leader_host() -> str:
    """The IP of rank 0 as the launcher's hostfile names it (ring backend)."""
    path = os.environ.get(HOSTFILE_VARIABLE)
    if not path:
        raise DistributedError(f"{HOSTFILE_VARIABLE} is not set: start the ranks with mlx.launch --backend ring")
    try:
        with open(path, encoding="utf-8") as handle:
            hosts = json.load(handle)
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
        return str(first).rsplit(":", 1)[0]
    except (OSError, ValueError, IndexError, KeyError, TypeError) as exc:
        raise DistributedError(f"{HOSTFILE_VARIABLE}={path}: cannot read rank 0's address ({exc})") from exc
