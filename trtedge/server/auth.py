"""API-key check for /v1/*: `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from trtedge.server.errors import APIError


def key_matches(headers: dict[str, str], api_key: str) -> bool:
    given = headers.get("x-api-key")
    auth = headers.get("authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if not given:
        return False
    return hmac.compare_digest(given.encode(), api_key.encode())


class APIKeyMiddleware:
    """Guards every path under /v1/ when a key is configured; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if not key_matches(headers, self.api_key):
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    code="invalid_api_key",
                )
                response = error.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
