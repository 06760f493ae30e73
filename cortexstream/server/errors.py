"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error",
}


class APIError(Exception):
    """A client-visible error; raised anywhere in a handler, rendered by `error_response`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(exc: APIError, request: Request | None = None) -> JSONResponse:
    """OpenAI's error body, or the body of the API a path prefix belongs to (`app.state.error_bodies`: prefix ->
    APIError -> body, e.g. Anthropic's for /v1/messages)."""
    body = error_body(exc.status, exc.message, exc.param, exc.code)
    bodies = getattr(request.app.state, "error_bodies", {}) if request is not None else {}
    for prefix, render in bodies.items():
        if request.url.path.startswith(prefix):
            body = render(exc)
            break
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":  # the body is not JSON at all: 400 like OpenAI
        return error_response(APIError(400, f"invalid JSON body: {first.get('msg', 'parse error')}",
                                       code="invalid_json"), request)
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
        for e in errors[:5]
    )
    return error_response(APIError(422, message, param=param, code="invalid_value"), request)


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)), request)


def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug of ours, not the client's: still OpenAI's body, and the worker stays up.
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"), request)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
