"""API keys for /v1/* and the tokenizer endpoints: `Authorization: Bearer KEY` or `x-api-key: KEY`.

Keys are compared as SHA-256 digests with ``hmac.compare_digest`` and every configured key is
compared on every request, so the time taken says nothing about a key's content or which key
matched. A key is never logged or echoed. With an API-key map (``--api-key-file``) each key names
a tenant; the tenant becomes the request's cache domain (see ``cache_salt``).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from trtedge.server.errors import APIError

GUARDED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # besides every path under /v1/


def given_key(headers: dict[str, str]) -> str | None:
    key = headers.get("x-api-key")
    auth = headers.get("authorization", "")
    if key is None and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    return key or None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The accepted keys: ``api_key`` (no tenant) and ``tenants`` (tenant name -> key)."""

    def __init__(self, api_key: str | None = None, tenants: dict[str, str] | None = None):
        self._keys = [(_digest(api_key), None)] if api_key else []
        self._keys += [(_digest(key), name) for name, key in (tenants or {}).items()]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, key: str | None) -> tuple[bool, str | None]:
        """(matched, tenant). Compares against every key, whatever matches first."""
        digest = _digest(key or "")
        matched, tenant = False, None
        for known, name in self._keys:
            if hmac.compare_digest(digest, known) and key:
                matched, tenant = True, name
        return matched, tenant


def cache_salt(request: Request, salt: str | None) -> str | None:
    """The salt mixed into the request's prefix hashes: its tenant (from the API-key map) and its own
    ``cache_salt``, so that neither tenants nor salts ever share cached prefixes."""
    tenant = request.scope.get("state", {}).get("tenant")
    if tenant is None:
        return salt
    return f"tenant:{tenant}\0{salt or ''}"


class APIKeyMiddleware:
    """Guards every path under /v1/ and GUARDED_PATHS when keys are configured; /health and /metrics
    stay open."""

    def __init__(self, app: ASGIApp, api_key: str | None, tenants: dict[str, str] | None = None):
        self.app = app
        self.keys = KeyRing(api_key, tenants)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if self.keys and scope["type"] == "http" and (path.startswith("/v1/") or path in GUARDED_PATHS):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            matched, tenant = self.keys.match(given_key(headers))
            if not matched:
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    code="invalid_api_key",
                )
                response = error.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
