"""`ApiError`: a client-visible failure with its HTTP status, rendered as an OpenAI or an Anthropic error body."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# OpenAI error `type` by status (what the official API and vLLM send).
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                 500: "internal_server_error", 503: "service_unavailable"}
# Anthropic error `type` by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class ErrorEvent(str):
    """A server-sent event that reports an error after the stream's 200 went out; `status` is the HTTP status the
    error stands for (what the request metrics count it as)."""

    status: int

    def __new__(cls, text: str, status: int) -> ErrorEvent:
        event = super().__new__(cls, text)
        event.status = status
        return event


class ApiError(Exception):
    """Raised anywhere in request handling; the app turns it into a JSON error response with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def openai_body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """`{"type": "error", "error": {"type", "message"}}`."""
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def openai_event(self) -> ErrorEvent:
        """The error as an OpenAI stream's event (`data: {"error": ...}`)."""
        return ErrorEvent(f"data: {json.dumps(self.openai_body())}\n\n", self.status)

    def anthropic_event(self) -> ErrorEvent:
        """The error as an Anthropic stream's `error` event."""
        return ErrorEvent(f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n", self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of pydantic validation errors, naming the field path of the most specific error.

    A value that fits no member of a union (message content that is a string or a list of blocks) gets one error per
    member; the deepest one says what is wrong (``messages.0.content.0.input: Input should be a valid dictionary``),
    and the union members pydantic puts in the path (``str``, ``list[ContentBlock]``) are left out of it.
    """
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _field_path(first)
    # A union's other members fail at the same field or an ancestor of it ("content" is not a string either).
    others = {p for p in map(_field_path, errors) if p != param and not (param or "").startswith(f"{p}.")}
    more = f" (and errors in {len(others)} more fields)" if others else ""
    return f"{param}: {first.get('msg', 'invalid value')}{more}" if param else first.get("msg", "invalid"), param


def _field_path(error: Mapping[str, Any]) -> str | None:
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_member(p)) or None


def _is_union_member(part: object) -> bool:
    # Field names in our request models are snake_case; pydantic's union tags are type names.
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict", "none"}
                                      or "[" in part or part[:1].isupper())
