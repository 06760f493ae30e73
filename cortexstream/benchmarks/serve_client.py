"""Drive one server with a workload through real HTTP streaming (httpx, Server-Sent Events), timing each token.

httpx comes with the `bench` extra and is imported only when a workload is driven, so the records and the report
(and `cortexstream bench --help`) work without it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cortexstream.benchmarks.serve_workloads import Session, WorkloadSpec

if TYPE_CHECKING:
    import httpx


@dataclass
class RequestRecord:
    sent: float
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0
    chunks: int = 0
    error: str | None = None
    done: bool = False  # the stream ended normally ([DONE] or the end of the body)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token is None or self.last_token is None or self.output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)


@dataclass
class WorkloadRun:
    records: list[RequestRecord] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0


async def _stream_turn(http: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                       record: RequestRecord) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    usage_tokens = None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    record.first_token = record.first_token or now
                    record.last_token = now
                    record.chunks += 1
                    pieces.append(content)
    # Token counts from the server's usage when it reports them; else one token per content chunk.
    record.output_tokens = usage_tokens if usage_tokens is not None else record.chunks
    record.done = True
    return "".join(pieces)


async def _session(http: httpx.AsyncClient, url: str, model: str, session: Session, t0: float,
                   run: WorkloadRun) -> None:
    import httpx

    await asyncio.sleep(max(0.0, t0 + session.start - time.perf_counter()))
    messages: list[dict] = [{"role": "system", "content": session.system}] if session.system else []
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user_text})
        record = RequestRecord(sent=time.perf_counter())
        run.records.append(record)
        try:
            reply = await _stream_turn(http, url, model, messages, turn.max_tokens, record)
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            return
        if record.error:
            return
        messages.append({"role": "assistant", "content": reply})


async def drive(url: str, workload: WorkloadSpec, timeout: float, model: str = "default_model") -> WorkloadRun:
    """Run every session of `workload` against `url`, asking for `model`. Past `timeout` seconds the sessions are
    cancelled and each request still streaming is recorded as failed ("timed out"), so a slow server shows up in
    the report instead of stopping the benchmark."""
    import httpx

    run = WorkloadRun()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as http:
        run.started = time.perf_counter()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(_session(http, url, model, s, run.started, run) for s in workload.sessions)),
                timeout)
        except asyncio.TimeoutError:
            for record in run.records:
                if record.error is None and not record.done:
                    record.error = f"timed out after {timeout:g} s"
        run.finished = time.perf_counter()
    return run
