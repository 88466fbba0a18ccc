"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from starlette.responses import JSONResponse

from trtedge.llm import EngineUnavailableError

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    501: "not_implemented_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as is: never carries a traceback or internal detail."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(feature: str, param: str) -> APIError:
    return APIError(
        400, f"{feature} is not supported yet in this version of trtedge", param=param, code="unsupported"
    )


def overloaded(message: str, retry_after: int) -> APIError:
    return APIError(
        429, message, code="rate_limit_exceeded", headers={"Retry-After": str(max(1, int(retry_after)))}
    )


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")


def internal_error() -> APIError:
    return APIError(500, "internal server error; see the server log", code="internal_error")


def engine_failure(error: BaseException) -> APIError:
    """What a client sees when the engine failed its request: 503 ``engine_unavailable`` (with the reason)
    if the engine has stopped, else 500 ``engine_error`` (the engine restarted; a retry is served)."""
    if isinstance(error, EngineUnavailableError):
        return engine_unavailable(str(error))
    return APIError(
        500,
        "the engine failed while generating this request and was restarted; retry the request",
        code="engine_error",
    )


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {redact(reason)}", code="engine_unavailable")


def redact(text: str) -> str:
    """``text`` without file paths (safe to show a client)."""
    return _PATH.sub("<path>", text)
