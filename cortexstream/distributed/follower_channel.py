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
from cortexstream.distributed.group import RankGroup, leader_host
from cortexstream.distributed.leader_channel import TOKEN_WORDS
from cortexstream.distributed.messages import Answer, AnswerKind


class LeaderState(enum.Enum):
    SENT = "sent"  # a message (a step, a heartbeat) is waiting to be read: rank 0 is alive
    SILENT = "silent"  # nothing waiting
    GONE = "gone"  # rank 0 closed the connection: its process ended


class FollowerChannel:
    def __init__(self, group: RankGroup, timeout: float) -> None:
        if not timeout > 0:
            raise DistributedError(f"timeout: {timeout!r} must be a number of seconds > 0")
        self.rank, self.timeout = group.rank, float(timeout)
        port, *token = group.broadcast_ints([0] * (1 + TOKEN_WORDS))
        host = leader_host()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise DistributedError(f"rank {self.rank}: cannot connect to rank 0 at {host}:{port} ({exc})") from exc
                time.sleep(0.1)
        self._answer(Answer(AnswerKind.HELLO, self.rank, text="-".join(map(str, token))))

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
