"""How a request fails: each error knows its HTTP status and its OpenAI-shaped body
(``{"error": {"message", "type", "param", "code"}}``, what OpenAI's clients parse)."""

from __future__ import annotations

from typing import Any, ClassVar

from ..core.errors import KasokuError


class ServeError(KasokuError):
    """An answer other than images; `message` says what is wrong and what to do."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.param = param
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class InvalidRequest(ServeError):
    """A bad size, field or image (400)."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(ServeError):
    """No key, or the wrong one, on a server started with --api-key-env (401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class QueueFull(ServeError):
    """The queue holds --max-queue images already (429, with Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class NotReady(ServeError):
    """The engines are still loading (503, with Retry-After)."""

    status = 503
    type = "server_error"
    code = "not_ready"


class TimedOut(ServeError):
    """Not answered within --timeout seconds (504)."""

    status = 504
    type = "timeout_error"
    code = "timeout"


__all__ = ["InvalidRequest", "NotReady", "QueueFull", "ServeError", "TimedOut", "Unauthorized", "error_body"]
