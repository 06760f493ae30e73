"""`POST /v1/messages` (+ `/v1/messages/count_tokens`) and `POST /v1/responses`: Anthropic's Messages and OpenAI's
Responses APIs on the same engine, tenants, metrics, limits and errors as /v1/chat/completions.

Each request is translated into a `ChatSpec` (anthropic_translate.py, openai_responses_translate.py), prepared like
a chat completion (agent_prepare.py: template with tools, grammar, tool-call parsing), and its token events become
`StreamDelta`s that the API's own encoder renders (anthropic_events.py, openai_responses_stream.py). A Responses
request with `previous_response_id` continues a conversation kept by the server's `ResponseStore`; its prompt is the
earlier turns re-rendered, so the prefix cache serves them while their blocks are in the arena.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cortexstream.server.agent_turn import TurnState
from cortexstream.server.anthropic_events import (AnthropicStreamEncoder, anthropic_error_event, anthropic_message,
                                                  anthropic_stop_reason, anthropic_token_count, new_message_id)
from cortexstream.server.anthropic_protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from cortexstream.server.anthropic_translate import anthropic_to_chat
from cortexstream.server.chat_spec import ChatSpec
from cortexstream.server.errors import APIError
from cortexstream.server.openai_responses_events import new_response_id, request_echo, responses_body, responses_status
from cortexstream.server.openai_responses_protocol import ResponsesRequest
from cortexstream.server.openai_responses_stream import ResponsesStreamEncoder
from cortexstream.server.openai_responses_translate import responses_conversation, responses_to_chat
from cortexstream.server.prepare import check_model, prepare_spec
from cortexstream.server.agent_prepare import prepare_turn
from cortexstream.server.routes import check_capacity, collect, next_events, require_tenant, submit

agent_router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request) -> Any:
    return request.app.state.server


async def _start(request: Request, spec: ChatSpec, prefix: str, tenant: str | None) -> TurnState:
    state = _state(request)
    check_model(spec.model, state.model_name)
    check_capacity(state)
    prepared, _ = prepare_spec(spec, prefix, state.tokenizer, state.arena_limits, state.default_policy, tenant,
                               state.config.default_chat_max_tokens, state.tools)
    handle = await submit(state, prepared)
    parser = state.tools.parser(prepared.tool_names) if prepared.parse_tools else None
    return TurnState(handle, prepared.prompt_tokens, parser)


def _stream(request: Request, turn: TurnState, render: Callable[[Any], bytes], finish: Callable[[], bytes],
            fail: Callable[[APIError], bytes], head: bytes = b"") -> StreamingResponse:
    state = _state(request)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield head
            while not turn.finished:
                for event in await next_events(turn.handle):
                    yield b"".join(render(delta) for delta in turn.add(event))
            yield finish()
        except APIError as exc:  # headers are sent: the error travels as an event
            yield fail(exc)
        finally:
            if not turn.finished:
                state.bridge.abort(turn.handle)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


# --- Anthropic Messages -----------------------------------------------------------------------------------------
@agent_router.post("/v1/messages")
async def messages(body: AnthropicMessagesRequest, request: Request,
                   tenant: str | None = Depends(require_tenant)) -> Any:
    state = _state(request)
    turn = await _start(request, anthropic_to_chat(body), "msg", tenant)
    message_id = new_message_id()

    def stop() -> tuple[Any, str | None]:
        sequence = turn.stop_sequence
        return anthropic_stop_reason(turn.finish_reason, bool(turn.tool_calls), sequence), sequence

    if not body.stream:
        await collect(request, turn.handle, turn.add)
        reason, sequence = stop()
        return JSONResponse(anthropic_message(message_id, state.model_name, turn.text, turn.tool_calls, reason,
                                              turn.prompt_tokens, turn.output_tokens, sequence))
    encoder = AnthropicStreamEncoder(message_id, state.model_name, turn.prompt_tokens)

    def finish() -> bytes:
        reason, sequence = stop()
        return encoder.finish(reason, turn.output_tokens, sequence)

    return _stream(request, turn, encoder.feed, finish, anthropic_error_event, encoder.start())


@agent_router.post("/v1/messages/count_tokens")
async def count_tokens(body: AnthropicCountTokensRequest, request: Request,
                       tenant: str | None = Depends(require_tenant)) -> Any:
    state = _state(request)
    spec = anthropic_to_chat(body)
    check_model(spec.model, state.model_name)
    turn = prepare_turn(spec, state.tokenizer, state.tools)
    return JSONResponse(anthropic_token_count(len(turn.tokens)))


# --- OpenAI Responses -------------------------------------------------------------------------------------------
@agent_router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, tenant: str | None = Depends(require_tenant)) -> Any:
    state = _state(request)
    previous = state.response_store.get(body.previous_response_id) if body.previous_response_id else None
    turn = await _start(request, responses_to_chat(body, previous), "resp", tenant)
    response_id, echo = new_response_id(), request_echo(body)

    def remember() -> None:
        if body.store is not False:
            state.response_store.record(response_id, responses_conversation(body, previous), turn.text,
                                        turn.tool_calls)

    if not body.stream:
        await collect(request, turn.handle, turn.add)
        remember()
        return JSONResponse(responses_body(response_id, state.model_name, echo, turn.text, turn.tool_calls,
                                           responses_status(turn.finish_reason), turn.prompt_tokens,
                                           turn.output_tokens, turn.cached_tokens))
    encoder = ResponsesStreamEncoder(response_id, state.model_name, echo)

    def finish() -> bytes:
        remember()
        return encoder.finish(responses_status(turn.finish_reason), turn.prompt_tokens, turn.output_tokens,
                              turn.cached_tokens)

    return _stream(request, turn, encoder.feed, finish, encoder.error, encoder.start())

