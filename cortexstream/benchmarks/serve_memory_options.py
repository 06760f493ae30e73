"""The options of the memory_bound workload of `cortexstream bench serve`: the flags, and the checked settings
(`MemoryBoundOptions`) they become before anything is converted or started."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from cortexstream.benchmarks.serve_processes import PEER_KV_BITS, Peer, peer_script
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.kv_dtype import GROUP_SIZES, StorageType, parse_kv_dtype

# Flags only the memory_bound workload reads (their defaults are None, so a flag given without it is refused).
FLAGS = ("kv_dtypes", "kv_budget_mib", "kv_group_size", "sessions", "history_tokens", "sample_interval",
         "peer_python", "peer_kv_bits")


def add_memory_arguments(parser: argparse.ArgumentParser, workload: str) -> None:
    group = parser.add_argument_group(f"{workload} workload")
    group.add_argument("--kv-dtypes", default=None,
                       help="cortexstream serve's KV storage types, one run each at the same --kv-budget-mib "
                            "(comma-separated; k=<type>,v=<type> stays one entry; default float32,int8,int4); "
                            "ratios are against the first float one")
    group.add_argument("--kv-budget-mib", type=float, default=None,
                       help="KV arena size of every cortexstream run, MiB (default 256)")
    group.add_argument("--kv-group-size", type=int, default=None, choices=GROUP_SIZES,
                       help="group size of the int8/int4 runs (default: cortexstream serve's)")
    group.add_argument("--sessions", type=int, default=None,
                       help="conversations, all started at once (default 32; 3 with --quick)")
    group.add_argument("--history-tokens", type=int, default=None,
                       help="each conversation's own system+history text (default 1500; --quick: 60)")
    group.add_argument("--sample-interval", type=float, default=None,
                       help="seconds between two reads of the server's running/waiting gauges (default 0.25)")
    group.add_argument("--peer-python", action="append", default=None, metavar="NAME=PYTHON",
                       help=f"also run peer NAME ({', '.join(p.value for p in Peer)}) from the venv of this python, "
                            "its KV quantization on (repeatable; nothing is installed)")
    group.add_argument("--peer-kv-bits", type=int, default=None, choices=PEER_KV_BITS,
                       help="the peers' KV quantization bits (default 8)")


def parse_kv_dtypes(text: str, group_size: int | None = None) -> tuple[str, ...]:
    """`--kv-dtypes`: comma-separated storage types; a `k=..,v=..` pair stays one entry."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part.lower().startswith("v=") and items and items[-1].lower().startswith("k=") and "," not in items[-1]:
            items[-1] += "," + part
        elif part:
            items.append(part)
    if not items:
        raise InvalidArgumentError("--kv-dtypes: give at least one KV storage type, e.g. float32,int8,int4")
    if len(set(items)) != len(items):
        raise InvalidArgumentError(f"--kv-dtypes: {text!r} names a storage type twice")
    quantized = [is_quantized(item) for item in items]  # checks every spelling
    if group_size is not None and not any(quantized):
        raise InvalidArgumentError(f"--kv-group-size: {group_size} given, but --kv-dtypes {text!r} quantizes nothing")
    return tuple(items)


def is_quantized(kv_dtype: str) -> bool:
    """Whether `kv_dtype` stores K or V as int8/int4 (an InvalidArgumentError naming --kv-dtypes if misspelt)."""
    try:
        return parse_kv_dtype(kv_dtype, model_dtype=StorageType.FLOAT32).quantized
    except ValueError as exc:
        raise InvalidArgumentError(f"--kv-dtypes: {kv_dtype!r}: {exc}") from exc


def parse_peer_pythons(items: list[str] | None) -> dict[Peer, str]:
    """`--peer-python NAME=/venv/bin/python` (repeatable): the peers to run, each from its own venv."""
    out: dict[Peer, str] = {}
    names = ", ".join(p.value for p in Peer)
    for item in items or []:
        name, sep, python = item.partition("=")
        if not sep or not name.strip() or not python.strip():
            raise InvalidArgumentError(f"--peer-python: {item!r} must be NAME=/path/to/venv/bin/python ({names})")
        try:
            peer = Peer(name.strip().replace("-", "_"))
        except ValueError:
            raise InvalidArgumentError(f"--peer-python: {name!r} is not a peer; choose from {names}") from None
        if peer in out:
            raise InvalidArgumentError(f"--peer-python: {peer} given twice")
        python = python.strip()
        if not Path(python).is_file():
            raise InvalidArgumentError(f"--peer-python: {peer}: {python} is not a file")
        if not peer_script(python, peer).is_file():
            raise InvalidArgumentError(f"--peer-python: {peer}: no {peer.script} beside {python} (is {peer} "
                                       "installed in that venv?)")
        out[peer] = python
    return out


@dataclass(frozen=True)
class MemoryBoundOptions:
    """The memory_bound workload's settings; `sessions` None: 32, or 3 with --quick."""

    kv_dtypes: tuple[str, ...] = ("float32", "int8", "int4")
    kv_budget_mib: float = 256.0
    kv_group_size: int | None = None
    sessions: int | None = None
    history_tokens: int = 1500
    sample_interval: float = 0.25
    peers: tuple[tuple[Peer, str], ...] = ()  # (peer, its venv's python)
    peer_kv_bits: int = 8

    def __post_init__(self) -> None:
        parse_kv_dtypes(",".join(self.kv_dtypes), self.kv_group_size)
        for flag, value in (("--kv-budget-mib", self.kv_budget_mib), ("--sample-interval", self.sample_interval)):
            if not value > 0:
                raise InvalidArgumentError(f"{flag}: {value!r} must be > 0")
        for flag, count in (("--sessions", self.sessions), ("--history-tokens", self.history_tokens)):
            if count is not None and count < 1:
                raise InvalidArgumentError(f"{flag}: {count!r} must be >= 1")
        if self.peer_kv_bits not in PEER_KV_BITS:
            raise InvalidArgumentError(f"--peer-kv-bits: {self.peer_kv_bits!r} must be one of {PEER_KV_BITS}")

    @property
    def budget_bytes(self) -> int:
        return int(self.kv_budget_mib * 2**20)

    def argv(self) -> list[str]:
        """These settings as flags, for the report's rerun line (a peer's python shown as PYTHON: a local path)."""
        out = ["--kv-dtypes", ",".join(self.kv_dtypes), "--kv-budget-mib", f"{self.kv_budget_mib:g}"]
        out += ["--kv-group-size", str(self.kv_group_size)] if self.kv_group_size is not None else []
        out += ["--sessions", str(self.sessions)] if self.sessions is not None else []
        out += ["--history-tokens", str(self.history_tokens), "--sample-interval", f"{self.sample_interval:g}"]
        for peer, _ in self.peers:
            out += ["--peer-python", f"{peer}=PYTHON"]
        return out + (["--peer-kv-bits", str(self.peer_kv_bits)] if self.peers else [])


def memory_options(args: argparse.Namespace, wanted: bool, workload: str) -> MemoryBoundOptions | None:
    """The settings when the workload is `wanted`; its flags given without it are refused (they would do nothing)."""
    given = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    if not wanted:
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise InvalidArgumentError(f"{flag}: only the {workload} workload takes it; add it to --workloads")
        return None
    if "kv_dtypes" in given:
        given["kv_dtypes"] = parse_kv_dtypes(given["kv_dtypes"], given.get("kv_group_size"))
    if "peer_python" in given:
        given["peers"] = tuple(parse_peer_pythons(given.pop("peer_python")).items())
    return MemoryBoundOptions(**given)
