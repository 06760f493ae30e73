"""API keys: `Authorization: Bearer KEY` checks, each key its own prefix-cache tenant.

The tenant is the salt of the prefix cache's hash chain, so two keys never reuse each other's KV blocks, even
for the same system prompt. Tenants are labelled `key-<n>` (the key's position) wherever they are shown; a key
itself never appears in a response, a metric or a log line.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from cortexstream.server.errors import APIError


def read_key_file(path: str) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--api-keys: cannot read {path}: {exc.strerror or exc}") from exc
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ValueError(f"--api-keys: {path} holds no keys")
    return keys


class KeyRing:
    """Maps a request's Authorization header to its tenant label (None when auth is off)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [(key.encode("utf-8"), f"key-{i}") for i, key in enumerate(keys)]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant_for(self, authorization: str | None, api_key: str | None = None) -> str | None:
        """The tenant of a request's key: `Authorization: Bearer <key>` (OpenAI's clients) or, without that
        header, `x-api-key: <key>` (Anthropic's)."""
        if not self._keys:
            return None
        if not authorization and api_key and api_key.strip():
            token = api_key
        elif not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           code="invalid_api_key")
        else:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'",
                               code="invalid_api_key")
        given = token.strip().encode("utf-8")
        label = None
        for key, tenant in self._keys:  # compare with every key in constant time; never stop early
            if hmac.compare_digest(given, key):
                label = tenant
        if label is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return label


class AuthMiddleware:
    """Checks the key of every /v1/ request before anything else (body parsing included), so a request without
    a valid key gets 401 whatever its body; the tenant label goes to `request.state.tenant`."""

    def __init__(self, app, keys: KeyRing) -> None:  # noqa: ANN001 - an ASGI app
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        header, api_key = (headers[name].decode("latin-1") if name in headers else None
                           for name in (b"authorization", b"x-api-key"))
        try:
            tenant = self.keys.tenant_for(header, api_key)
        except APIError as exc:
            from starlette.requests import Request

            from cortexstream.server.errors import error_response

            # The request's own API's error body (Anthropic's on /v1/messages): the app is in the scope.
            await error_response(exc, Request(scope) if "app" in scope else None)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
