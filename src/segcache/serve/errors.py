"""`APIError`: what a request did wrong, as an HTTP status and an OpenAI-style error body."""

from __future__ import annotations


class APIError(Exception):
    """A request the server refuses; the server itself is unaffected.

    Args:
        status: HTTP status (4xx for the client's fault, 5xx for ours).
        message: what was asked, what is wrong, what to do.
        param: the request field at fault (None when no single field is).
        code: a machine-readable reason, e.g. "context_length_exceeded".
        type: OpenAI's error type ("invalid_request_error" unless given).
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
