"""`ResponseStore`: the conversations of recent Responses-API responses, so `previous_response_id` can continue one.

Each entry maps a response id to the full message list of its conversation in chat-template form (the previous
conversation, the request's input, and the response's own assistant turn; without `instructions`, which a later
request does not inherit). The store is bounded by a count of entries and forgets the least recently used: a
request naming a forgotten response gets a 400, as one naming an unknown id does. It lives in the server's memory
only, so it is empty after a restart.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

from cortexstream.server.chat_spec import assistant_turn
from cortexstream.server.tool_types import ToolCall

DEFAULT_CAPACITY = 1024


class ResponseStore:
    """A bounded LRU map: response id -> conversation messages. Safe to use from several threads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity: must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        """Keep a copy of `messages` under `response_id` (replacing an entry of that id), evicting the least
        recently used entry when full."""
        if not isinstance(response_id, str) or not response_id:
            raise ValueError("response_id: must be a non-empty string")
        kept = copy.deepcopy(messages)
        with self._lock:
            self._entries[response_id] = kept
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def record(self, response_id: str, conversation: list[dict[str, Any]], text: str,
               tool_calls: list[ToolCall]) -> None:
        """Keep `conversation` (the request's, see `responses_conversation`) followed by the response's turn."""
        self.put(response_id, [*conversation, assistant_turn(text, tool_calls)])

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """A copy of the conversation stored under `response_id` (now the most recently used), or None."""
        with self._lock:
            messages = self._entries.get(response_id)
            if messages is None:
                return None
            self._entries.move_to_end(response_id)
            return copy.deepcopy(messages)

    def __contains__(self, response_id: object) -> bool:
        with self._lock:
            return response_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
