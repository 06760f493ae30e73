"""Length-prefixed frames over a TCP socket, with a deadline on every receive."""

from __future__ import annotations

import socket
import struct

_HEADER = struct.Struct("!Q")
MAX_FRAME = 1 << 31  # a plan with disk restores is refused before sending, so frames stay far below this


class ChannelClosed(ConnectionError):
    """The peer closed the connection (its process ended)."""


class ChannelTimeout(TimeoutError):
    """Nothing arrived before the deadline."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except socket.timeout as exc:
            raise ChannelTimeout() from exc
        if not chunk:
            raise ChannelClosed()
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, timeout: float | None) -> bytes:
    """The next frame's payload; ChannelTimeout when its first byte does not come within `timeout` seconds (None:
    wait for ever), ChannelClosed when the peer has gone."""
    sock.settimeout(timeout)
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes: larger than {MAX_FRAME}, the stream is corrupt")
    return _recv_exact(sock, size)
