"""Server-Sent Events with an `event:` line, split back into (event type, JSON data) for the protocol tests."""

from __future__ import annotations

import json


def parse_sse(raw: bytes) -> list[tuple[str, dict]]:
    events = []
    for chunk in raw.decode().split("\n\n")[:-1]:
        event_line, data_line = chunk.split("\n")
        events.append((event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return events
