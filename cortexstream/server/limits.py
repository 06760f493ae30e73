"""Size caps on request headers and bodies, enforced before any handler runs (413 with OpenAI's error body).

A pure ASGI middleware: the Content-Length is checked up front, and a chunked body is counted as it arrives,
so an oversized upload is refused without being buffered whole.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from cortexstream.server.errors import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _TooLarge(Exception):
    pass


async def _send_413(send: Send, message: str) -> None:
    body = json.dumps(error_body(413, message, code="request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class SizeLimitMiddleware:
    def __init__(self, app: Callable, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.max_headers = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        header_bytes = sum(len(k) + len(v) + 4 for k, v in headers)
        if header_bytes > self.max_headers:
            await _send_413(send, f"request headers are {header_bytes} bytes; the limit is {self.max_headers}")
            return
        for key, value in headers:
            if key == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length > self.max_body:
                    await _send_413(send, f"request body is {length} bytes; the limit is {self.max_body}")
                    return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _TooLarge()
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await _send_413(send, f"request body exceeds the limit of {self.max_body} bytes")
