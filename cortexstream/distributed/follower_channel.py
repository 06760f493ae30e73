"""The other ranks' end of the control channel (see leader_channel.py): connect to rank 0, receive its messages
with a deadline, answer each one."""

from __future__ import annotations

import enum
import pickle
import socket
import time
from typing import Any

from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.frames import ChannelClosed, ChannelTimeout, recv_frame, send_frame
from cortexstream.distributed.control_address import CONTROL_HOST_VARIABLE, WIRE_INTS, ControlAddress, machine_id
from cortexstream.distributed.group import RankGroup
from cortexstream.distributed.leader_channel import TOKEN_WORDS
from cortexstream.distributed.messages import Answer, AnswerKind

ATTEMPT_SECONDS = 2.0  # one connection attempt to one of rank 0's addresses (a firewall that drops: a timeout)


class LeaderState(enum.Enum):
    SENT = "sent"  # a message (a step, a heartbeat) is waiting to be read: rank 0 is alive
    SILENT = "silent"  # nothing waiting
    GONE = "gone"  # rank 0 closed the connection: its process ended


class FollowerChannel:
    def __init__(self, group: RankGroup, timeout: float) -> None:
        if not timeout > 0:
            raise DistributedError(f"timeout: {timeout!r} must be a number of seconds > 0")
        self.group, self.rank, self.timeout = group, group.rank, float(timeout)
        values = group.broadcast_ints([0] * (WIRE_INTS + TOKEN_WORDS))
        address, token = ControlAddress.from_ints(values[:WIRE_INTS]), values[WIRE_INTS:]
        self._sock = self._connect(address)
        self._answer(Answer(AnswerKind.HELLO, self.rank, text="-".join(map(str, token))))

    def _connect(self, address: ControlAddress) -> socket.socket:
        """A connection to the first of rank 0's addresses that accepts one, tried in turn until `timeout`."""
        hosts = address.targets(machine_id())
        if not hosts:
            raise DistributedError(f"rank {self.rank}: rank 0 runs on another machine and found no address of its "
                                   f"own to announce: set {CONTROL_HOST_VARIABLE} to one the other ranks reach")
        deadline = time.monotonic() + self.timeout
        errors: dict[str, str] = {}
        while True:
            for host in hosts:
                left = deadline - time.monotonic()
                attempt = max(0.1, min(ATTEMPT_SECONDS, left))
                try:
                    return socket.create_connection((host, address.port), timeout=attempt)
                except OSError as exc:
                    errors[host] = str(exc)
            if time.monotonic() > deadline:
                tried = "; ".join(f"{host}:{address.port}: {error}" for host, error in errors.items())
                raise DistributedError(f"rank {self.rank}: cannot connect to rank 0 ({tried}); set "
                                       f"{CONTROL_HOST_VARIABLE} to an address of rank 0's machine the other ranks "
                                       "reach")
            time.sleep(0.1)

    def receive(self) -> Any:
        """Rank 0's next message. DistributedError when rank 0 has gone or sent nothing (not even a heartbeat)
        for `timeout` seconds."""
        try:
            return pickle.loads(recv_frame(self._sock, self.timeout))
        except ChannelTimeout:
            raise DistributedError(f"rank {self.rank}: rank 0 sent nothing for {self.timeout:g} s (not even a "
                                   "heartbeat): it died or hangs") from None
        except (ChannelClosed, OSError) as exc:
            raise DistributedError(f"rank {self.rank}: rank 0 closed the connection ({type(exc).__name__}): its "
                                   "process has ended") from None

    def ack(self, step: int, text: str = "") -> None:
        """Every step up to `step` is computed (`text`: at shutdown, this rank's BlockLedger digest)."""
        self._answer(Answer(AnswerKind.ACK, self.rank, step=step, text=text))

    def fail(self, reason: str) -> None:
        """Tell rank 0 why this rank stops (best effort: rank 0 may be gone)."""
        try:
            self._answer(Answer(AnswerKind.FAILURE, self.rank, text=reason))
        except DistributedError:
            pass

    def leader_state(self) -> LeaderState:
        """What rank 0's connection shows now, without waiting or consuming anything."""
        try:
            return LeaderState.SENT if self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else LeaderState.GONE
        except BlockingIOError:
            return LeaderState.SILENT
        except OSError:
            return LeaderState.GONE

    def close(self) -> None:
        self._sock.close()

    def _answer(self, answer: Answer) -> None:
        try:
            send_frame(self._sock, answer.encode())
        except OSError as exc:
            raise DistributedError(f"rank {self.rank}: cannot reach rank 0 ({exc}): its process has ended") from exc
