"""Where rank 0's control channel listens, and how the other ranks reach it.

Rank 0 listens on, in this order of preference:

1. `CORTEXSTREAM_CONTROL_HOST` (an IPv4 address or host name of rank 0's machine that every rank reaches), when set;
2. the IP of the first rank in the ring backend's hostfile (`MLX_HOSTFILE`, set by `mlx.launch --backend ring`);
3. otherwise (mpirun, which has no hostfile to read) every interface of its machine.

It then sends the port, the addresses to try and an id of its machine (a hash of its host name) to the other ranks
through one all-sum over the MLX group, so no address has to be agreed beforehand. A rank on rank 0's machine
tries 127.0.0.1 first when rank 0 listens on every interface; a rank on another machine tries the announced
addresses: the source address of rank 0's default route and the addresses its host name resolves to. When none of
them is the network the ranks share, set `CORTEXSTREAM_CONTROL_HOST` on rank 0 (`mpirun -x ...`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import zlib
from dataclasses import dataclass

from cortexstream.distributed.backends import HOSTFILE_VARIABLE
from cortexstream.distributed.errors import DistributedError

CONTROL_HOST_VARIABLE = "CORTEXSTREAM_CONTROL_HOST"
EVERY_INTERFACE = "0.0.0.0"
LOOPBACK = "127.0.0.1"
MAX_ADDRESSES = 4
WIRE_INTS = 4 + MAX_ADDRESSES  # port, machine id, every-interface flag, address count, the addresses (zero-padded)
ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: a UDP "connect" picks the default route's source, sends nothing


@dataclass(frozen=True)
class ControlAddress:
    """Rank 0's listening socket as the other ranks learn it."""

    port: int
    addresses: tuple[str, ...]  # IPv4 addresses of rank 0's machine, in the order to try
    every_interface: bool  # rank 0 listens on all its interfaces, loopback included
    machine: int  # machine_id() of rank 0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise DistributedError(f"port: {self.port} is not a TCP port")
        if len(self.addresses) > MAX_ADDRESSES or (not self.addresses and not self.every_interface):
            raise DistributedError(f"addresses: {len(self.addresses)} given, 1 to {MAX_ADDRESSES} needed "
                                   "(none only when rank 0 listens on every interface)")
        for address in self.addresses:
            ipaddress.IPv4Address(address)  # ValueError for anything but an IPv4 address

    def to_ints(self) -> list[int]:
        packed = [int(ipaddress.IPv4Address(address)) for address in self.addresses]
        return [self.port, self.machine, int(self.every_interface), len(packed),
                *packed, *[0] * (MAX_ADDRESSES - len(packed))]

    @classmethod
    def from_ints(cls, values: list[int]) -> "ControlAddress":
        if len(values) != WIRE_INTS:
            raise DistributedError(f"control address: {len(values)} numbers, {WIRE_INTS} expected")
        port, machine, every, count, *packed = values
        addresses = tuple(str(ipaddress.IPv4Address(value)) for value in packed[:count])
        return cls(port, addresses, bool(every), machine)

    def targets(self, machine: int) -> tuple[str, ...]:
        """The addresses a rank on machine `machine` tries, in order."""
        if self.every_interface and machine == self.machine:
            return (LOOPBACK, *[address for address in self.addresses if address != LOOPBACK])
        return self.addresses


def machine_id() -> int:
    """This machine's id for ControlAddress: the CRC-32 of its host name."""
    return zlib.crc32(socket.gethostname().encode())


def ring_leader_host() -> str:
    """The IP of rank 0 as the ring backend's hostfile names it."""
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


def own_addresses() -> tuple[str, ...]:
    """Non-loopback IPv4 addresses of this machine: its default route's source, then its host name's."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(ROUTE_PROBE)
            found.append(probe.getsockname()[0])
        except OSError:
            pass  # no default route
    try:
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass  # the host name does not resolve
    usable = [address for address in found
              if not (ipaddress.IPv4Address(address).is_loopback or ipaddress.IPv4Address(address).is_unspecified)]
    return tuple(dict.fromkeys(usable))[:MAX_ADDRESSES]


def _resolve(host: str, source: str) -> str:
    """`host`'s IPv4 address; DistributedError naming `source` (where the host came from) when it has none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError) as exc:
        raise DistributedError(f"{source}: {host!r} is not an IPv4 address or a host name with one ({exc})") from exc


def listen_address() -> tuple[str, tuple[str, ...]]:
    """Rank 0: (the address to bind, the addresses to announce), by the rule of the module's docstring."""
    named = os.environ.get(CONTROL_HOST_VARIABLE, "").strip()
    if named:
        address = _resolve(named, CONTROL_HOST_VARIABLE)
        return address, (address,)
    if os.environ.get(HOSTFILE_VARIABLE):
        address = _resolve(ring_leader_host(), HOSTFILE_VARIABLE)
        return address, (address,)
    return EVERY_INTERFACE, own_addresses()


__all__ = ["CONTROL_HOST_VARIABLE", "ControlAddress", "WIRE_INTS", "listen_address", "machine_id",
           "ring_leader_host"]
