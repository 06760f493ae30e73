"""Ranks on this machine started the way `mlx.launch --backend ring` starts them, for tests and benchmarks: two
consecutive free ports, a hostfile naming them, and each rank's environment (MLX_RANK, MLX_HOSTFILE)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from cortexstream.distributed.group import HOSTFILE_VARIABLE, LAUNCH_VARIABLE


def free_port_pair() -> int:
    """A port p with p and p + 1 free (mlx.launch's ring ranks listen on consecutive ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def write_local_hostfile(folder: str | Path) -> str:
    """A ring hostfile for two ranks on 127.0.0.1 (free consecutive ports) in `folder`; returns its path."""
    port = free_port_pair()
    path = Path(folder) / f"hosts-{port}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return str(path)


def rank_environment(rank: int, hostfile: str) -> dict[str, str]:
    """This process's environment as mlx.launch gives it to rank `rank`."""
    return {**os.environ, LAUNCH_VARIABLE: str(rank), HOSTFILE_VARIABLE: hostfile}


__all__ = ["free_port_pair", "rank_environment", "write_local_hostfile"]
