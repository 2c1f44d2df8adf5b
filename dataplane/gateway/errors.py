"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .http import Exchange

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
    504: "api_error",
}


class GatewayError(Exception):
    """A request the gateway answers itself, with an OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        # Fields beside OpenAI's in the error object (a 429's `limit`).
        self.extra: dict[str, object] = {}

    def body(self) -> dict[str, object]:
        body = error_body(self.status, self.message, code=self.code, param=self.param)
        if self.extra:
            body["error"].update(self.extra)  # type: ignore[attr-defined]
        return body

    def respond(self, exchange: Exchange, request_id: str | None = None) -> None:
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        exchange.respond(self.status, json.dumps(self.body()).encode(), headers=headers)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }


def error_json(status: int, message: str, code: str) -> bytes:
    """The body of an error the HTTP layer answers itself (a malformed request)."""
    return json.dumps(error_body(status, message, code=code)).encode()
