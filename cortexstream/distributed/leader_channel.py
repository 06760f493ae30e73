"""Rank 0's end of the control channel: a TCP connection to every other rank, with timeouts.

Start-up: rank 0 listens at a free port (on the address control_address.py chooses) and all-sums where it listens
and a random session token to the other ranks through the MLX group; each connects and sends the token, so nothing
else can join. Then rank 0 sends every message to every rank (pickled, in order) and each rank answers every
message with the last step it has computed (JSON). A reader thread per rank and one watchdog thread (plain Python,
no MLX) watch them:

- a rank that closes its connection (its process ended) or reports a failure stops the session;
- a rank that leaves a message unanswered for `timeout` seconds stops it (it died, hangs, or waits in a collective
  of the sharded model for a rank that hangs);
- when rank 0 has sent nothing for `timeout / 4` seconds it sends a heartbeat, so an idle rank 0 is told from a
  dead one, and an idle rank that stopped answering is found too.

Stopping calls `on_failure(reason)` once (the session's default prints the reason and ends the process: a rank
waiting in an MLX collective cannot be interrupted).
"""

from __future__ import annotations

import pickle
import secrets
import socket
import threading
import time
from typing import Any, Callable

from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.frames import ChannelClosed, ChannelTimeout, recv_frame, send_frame
from cortexstream.distributed.control_address import EVERY_INTERFACE, ControlAddress, listen_address, machine_id
from cortexstream.distributed.group import RankGroup
from cortexstream.distributed.messages import Answer, AnswerKind, Heartbeat, Stop

TOKEN_WORDS = 4  # the session token: 4 x 32 random bits


class LeaderChannel:
    def __init__(self, group: RankGroup, timeout: float, on_failure: Callable[[str], None]) -> None:
        if not timeout > 0:
            raise DistributedError(f"timeout: {timeout!r} must be a number of seconds > 0")
        self.group, self.timeout, self._on_failure = group, float(timeout), on_failure
        self._lock = threading.Lock()  # one sender at a time: messages reach every rank in one order
        self._state = threading.Lock()
        self._waiting: dict[int, float | None] = {}  # rank -> when the oldest unanswered message was sent
        self.acked: dict[int, int] = {}  # rank -> last step it computed
        self.gone: set[int] = set()  # ranks whose connection closed (their process ended)
        self.bytes_sent = 0  # payload bytes sent to all ranks (heartbeats included)
        self.digests: dict[int, str] = {}  # rank -> the BlockLedger digest it answered Stop with
        self._last_send = time.monotonic()
        self._failed: str | None = None
        self._closing = False
        self._socks = self._connect()
        self._threads = [threading.Thread(target=self._read, args=(rank, sock), daemon=True, name=f"rank{rank}-reader")
                         for rank, sock in self._socks.items()]
        self._threads.append(threading.Thread(target=self._watch, daemon=True, name="rank-watchdog"))
        for thread in self._threads:
            thread.start()

    def _connect(self) -> dict[int, socket.socket]:
        host, announced = listen_address()
        try:
            server = socket.create_server((host, 0))
        except OSError as exc:
            raise DistributedError(f"rank 0 cannot listen on {host} for the control channel ({exc})") from exc
        token = [secrets.randbits(32) for _ in range(TOKEN_WORDS)]
        address = ControlAddress(server.getsockname()[1], announced, host == EVERY_INTERFACE, machine_id())
        self.group.broadcast_ints([*address.to_ints(), *token])
        expected = "-".join(map(str, token))
        socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + self.timeout
        try:
            while len(socks) < self.group.size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.group.size)) - set(socks))
                    raise DistributedError(f"ranks {missing} did not connect to rank 0 within {self.timeout:g} s")
                server.settimeout(left)
                try:
                    sock, _ = server.accept()
                    hello = Answer.decode(recv_frame(sock, min(left, 10.0)))
                except (socket.timeout, ChannelTimeout, ChannelClosed, ValueError, OSError):
                    continue  # a stray or slow connection: not one of the ranks
                if hello.kind is AnswerKind.HELLO and hello.text == expected and 0 < hello.rank < self.group.size:
                    sock.settimeout(None)
                    socks[hello.rank] = sock
                else:
                    sock.close()
        finally:
            server.close()
        self._waiting = {rank: None for rank in socks}
        self.acked = {rank: 0 for rank in socks}
        return socks

    @property
    def failed(self) -> str | None:
        return self._failed

    def send(self, message: Any) -> None:
        """Send `message` to every other rank, in the order of calls. Raises DistributedError once the session
        has failed."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._failed is not None:
                raise DistributedError(f"the ranks have stopped: {self._failed}")
            unreachable = self._broadcast(payload, count=True)
            if unreachable is not None:
                raise DistributedError(f"the ranks have stopped: {self._failed}") from unreachable

    def wait_answered(self) -> None:
        """Wait until every rank has answered every message sent so far. DistributedError when the session fails
        meanwhile (a rank's failure, or no answer within `timeout`: the watchdog's verdict)."""
        deadline = time.monotonic() + 2 * self.timeout  # the watchdog fails the session after `timeout`
        while time.monotonic() < deadline:
            if self._failed is not None:
                raise DistributedError(f"the ranks have stopped: {self._failed}")
            with self._state:
                if all(since is None for since in self._waiting.values()):
                    return
            time.sleep(0.01)
        raise DistributedError(f"the ranks did not answer within {2 * self.timeout:g} s")

    def close(self, error: str | None = None) -> None:
        """Tell every rank to stop (with `error` when rank 0 failed) and wait up to `timeout` for them to go."""
        if self._failed is None and not self._closing:
            self._closing = True
            try:
                self.send(Stop(error))
            except DistributedError:
                pass
        deadline = time.monotonic() + self.timeout
        for thread in self._threads[:-1]:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._closing = True
        for sock in self._socks.values():
            sock.close()

    def _fail(self, reason: str) -> None:
        with self._state:
            if self._failed is not None or self._closing:
                return
            self._failed = reason
        self._on_failure(reason)

    def _read(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                answer = Answer.decode(recv_frame(sock, None))
            except (ChannelClosed, OSError, ValueError) as exc:
                self.gone.add(rank)
                if not self._closing:
                    self._fail(f"rank {rank} closed its connection ({type(exc).__name__}): its process has ended")
                return
            with self._state:
                self._waiting[rank] = None
                self.acked[rank] = max(self.acked[rank], answer.step)
                if answer.kind is AnswerKind.ACK and answer.text:
                    self.digests[rank] = answer.text
            if answer.kind is AnswerKind.FAILURE:
                self._fail(f"rank {rank} failed: {answer.text}")
                return

    def _watch(self) -> None:
        interval = self.timeout / 4
        while self._failed is None and not self._closing:
            time.sleep(min(interval, 0.5))
            now = time.monotonic()
            with self._state:
                late = [(rank, now - since) for rank, since in self._waiting.items()
                        if since is not None and now - since > self.timeout]
            if late:
                rank, waited = late[0]
                self._fail(f"rank {rank} has not answered for {waited:.0f} s (timeout {self.timeout:g} s): it died, "
                           "hangs, or waits for another rank that does")
                return
            if now - self._last_send > interval and self._lock.acquire(blocking=False):
                try:
                    if self._failed is None and not self._closing:
                        self._send_heartbeat()
                finally:
                    self._lock.release()

    def _send_heartbeat(self) -> None:
        self._broadcast(pickle.dumps(Heartbeat()), count=False)

    def _broadcast(self, payload: bytes, count: bool) -> OSError | None:
        """One frame to every rank, each then owing an answer (the watchdog's clock starts if it was not running).
        A rank that cannot be reached fails the session: its error is returned and the rest are not sent to.
        `count`: add the bytes to `bytes_sent` (plans and control messages, not heartbeats)."""
        now = time.monotonic()
        for rank, sock in self._socks.items():
            with self._state:
                if self._waiting[rank] is None:
                    self._waiting[rank] = now
            try:
                send_frame(sock, payload)
            except OSError as exc:
                self._fail(f"rank {rank} cannot be reached ({exc}): its process has ended")
                return exc
            if count:
                self.bytes_sent += len(payload)
        self._last_send = now
        return None
