"""The endpoints: /v1/chat/completions, /v1/completions, /v1/models, /v1/kv, /health, /metrics."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from cortexstream.errors import CortexStreamError, InvalidArgumentError
from cortexstream.server.jobs import RequestHandle, TokenEvent
from cortexstream.server.errors import APIError, error_body
from cortexstream.server.kv_view import kv_snapshot
from cortexstream.server.prepare import (PreparedRequest, check_model, check_policy, prepare_chat,
                                         prepare_completion)
from cortexstream.server.protocol import ChatCompletionRequest, CompletionRequest
from cortexstream.server.responses import SSE_DONE, ResponseBuilder, sse

router = APIRouter()


def _state(request: Request) -> Any:
    return request.app.state.server


def require_tenant(request: Request) -> str | None:
    """The tenant `AuthMiddleware` found for this request's key (None without keys)."""
    return getattr(request.state, "tenant", None)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    bridge = _state(request).bridge
    if bridge.failure is not None:
        return JSONResponse({"status": "failed", "reason": bridge.failure}, status_code=503)
    alive = bridge.engine_running
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    state = _state(request)
    try:
        view = await asyncio.to_thread(state.bridge.client.snapshot, False)
    except CortexStreamError:  # the engine thread is gone: Metrics shows the last view it had
        view = None
    return PlainTextResponse(state.metrics.render(view), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request, tenant: str | None = Depends(require_tenant)) -> dict[str, Any]:
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.started,
                                        "owned_by": "cortexstream"}]}


@router.get("/v1/kv")
async def kv(request: Request, tenant: str | None = Depends(require_tenant)) -> dict[str, Any]:
    state = _state(request)
    bridge = state.bridge
    # The view and the owner -> tenant map in one engine-thread turn (the engine thread updates the map).
    view, owner_tenants = await asyncio.to_thread(
        bridge.client.call, lambda engine: (engine.snapshot(), dict(bridge.owner_tenants)))
    return kv_snapshot(view, owner_tenants, state.keys.enabled, viewer=tenant)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           tenant: str | None = Depends(require_tenant)) -> Any:
    state = _state(request)
    check_model(body.model, state.model_name)
    prepared = prepare_chat(body, state.tokenizer, state.arena_limits, state.default_policy, tenant,
                            state.config.default_chat_max_tokens, state.tools)
    check_policy(body.kv_policy, prepared, state.bridge.policy_problem)
    return await _serve(request, "chat", body, prepared)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      tenant: str | None = Depends(require_tenant)) -> Any:
    state = _state(request)
    check_model(body.model, state.model_name)
    prepared = prepare_completion(body, state.tokenizer, state.arena_limits, state.default_policy, tenant,
                                  state.config.default_completion_max_tokens)
    check_policy(body.kv_policy, prepared, state.bridge.policy_problem)
    return await _serve(request, "completion", body, prepared)


# --- shared machinery ---------------------------------------------------------------------------------------------
def check_capacity(state: Any) -> None:
    if state.bridge.failure is not None:
        raise APIError(503, state.bridge.failure, code="engine_failed")
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if state.bridge.num_active >= state.config.max_in_flight:
        raise APIError(429, f"too many requests in flight ({state.config.max_in_flight}); retry shortly",
                       code="queue_full", headers={"Retry-After": "1"})


async def submit(state: Any, prepared: PreparedRequest) -> RequestHandle:
    """Hand the job to the engine; 400 for what the engine refuses, 503 when it is gone."""
    try:
        handle = await state.bridge.submit(prepared.job)
    except InvalidArgumentError as exc:  # refused by the engine's own checks
        raise APIError(400, str(exc)) from exc
    except CortexStreamError as exc:  # the engine thread is stopping or gone
        raise APIError(503, f"engine unavailable: {exc}", code="engine_unavailable") from exc
    state.metrics.on_accepted(prepared.prompt_tokens)
    return handle


async def _serve(request: Request, kind: str, body: Any, prepared: PreparedRequest) -> Any:
    state = _state(request)
    check_capacity(state)
    job = prepared.job
    want_logprobs = job.top_logprobs is not None
    builder = ResponseBuilder(kind, prepared.response_id, state.model_name, len(job.request_ids),
                              prepared.prompt_tokens, state.token_text, want_logprobs,
                              partial(state.tools.parser, prepared.tool_names) if prepared.parse_tools else None)
    handle = await submit(state, prepared)
    if not body.stream:
        await collect(request, handle, builder.add)
        return JSONResponse(builder.body())
    disconnected = asyncio.ensure_future(_wait_disconnect(request))
    try:
        # Wait for the first event before answering, so a request that fails at once gets a proper status.
        first = await _race(next_events(handle), disconnected)
        entries = [(event, builder.add(event)) for event in first]
    except BaseException:
        state.bridge.abort(handle)
        raise
    finally:
        disconnected.cancel()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_stream(state, handle, builder, entries, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: Any, disconnected: asyncio.Future) -> Any:
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    raise asyncio.CancelledError("client disconnected")


async def next_events(handle: RequestHandle) -> list[TokenEvent]:
    """Every event available now (at least one): a whole engine step's worth is written in one go."""
    events = [await handle.events.get()]
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    for event in events:
        if isinstance(event, APIError):  # e.g. 503: the engine was declared failed (bridge.fail)
            raise event
        if isinstance(event, BaseException):
            raise APIError(500, f"{event}", code="engine_error")
        handle.mark_read(event)
    return events


async def _drain(handle: RequestHandle, add: Callable[[TokenEvent], Any]) -> None:
    # Until the final events are read, not merely delivered: a request can finish before its reader starts.
    while not handle.all_read:
        for event in await next_events(handle):
            add(event)


async def collect(request: Request, handle: RequestHandle, add: Callable[[TokenEvent], Any]) -> None:
    """Every event of `handle` into `add` until it finishes (a whole, non-streamed answer); the request is aborted
    if the client leaves or anything fails."""
    disconnected = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await _race(_drain(handle, add), disconnected)
    except BaseException:
        _state(request).bridge.abort(handle)
        raise
    finally:
        disconnected.cancel()


async def _stream(state: Any, handle: RequestHandle, builder: ResponseBuilder,
                  first: list[tuple[TokenEvent, Any]], include_usage: bool) -> AsyncIterator[bytes]:
    try:
        yield b"".join(builder.chunk(event, entry, include_usage) for event, entry in first)
        while not handle.all_read:
            events = await next_events(handle)
            yield b"".join(builder.chunk(event, builder.add(event), include_usage) for event in events)
        if include_usage:
            yield builder.usage_chunk()
        yield SSE_DONE
    except APIError as exc:  # headers are sent: the error travels as an SSE event, as OpenAI does
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
        yield SSE_DONE
    finally:
        if not handle.finished:
            state.bridge.abort(handle)  # client gone or failure: free its blocks at the next engine step


def token_text_for(tokenizer: Any) -> Any:
    """Decode one token id to its text (for log-probability entries)."""
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        value = cache.get(token)
        if value is None:
            value = tokenizer.decode([token])
            if len(cache) < 65536:
                cache[token] = value
        return value

    return text
