"""Errors as each API spells them.

Routes raise :class:`ApiError` (or let a runtime error through); the app turns
it into the body of the API the route belongs to (its *flavor*):

* ``anthropic`` — ``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}, "request_id": ...}``
* ``openai`` — ``{"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}``
* ``kvmem`` (agents, health, metrics) — ``{"error": {"type": ..., "message": ..., "param": ...}}``

A ``msgspec.ValidationError`` becomes a 400 whose ``param`` is the JSON path it names.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import msgspec

from runtime.errors import BudgetExceededError, ContextLengthExceededError, InvalidAgentIdError, ModelError

__all__ = [
    "ApiError",
    "Flavor",
    "flavor_of",
    "error_dict",
    "error_body",
    "from_exception",
    "from_decode_error",
    "runtime_errors",
    "without_server_paths",
    "DISK_CODES",
]

Flavor = Literal["anthropic", "openai", "kvmem"]

# Our kind -> (Anthropic error type, OpenAI error type)
_TYPES: dict[str, tuple[str, str]] = {
    "invalid_request": ("invalid_request_error", "invalid_request_error"),
    "authentication": ("authentication_error", "invalid_request_error"),
    "permission": ("permission_error", "invalid_request_error"),
    "not_found": ("not_found_error", "invalid_request_error"),
    "request_too_large": ("request_too_large", "invalid_request_error"),
    "overloaded": ("overloaded_error", "server_error"),
    "rate_limit": ("rate_limit_error", "rate_limit_error"),
    "api_error": ("api_error", "server_error"),
}

_PATH = re.compile(r" - at `(?:key` in `)?\$(?P<path>[^`]*)`$")  # a dict key's error names the dict
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


class ApiError(Exception):
    """An HTTP error with a status, a kind (see ``_TYPES``), a message and optional param/code."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        assert kind in _TYPES, kind
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


def flavor_of(path: str) -> Flavor:
    """Which API a URL path belongs to (for errors raised before a route runs)."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith(("/v1/chat/", "/v1/models", "/v1/completions")):
        return "openai"
    return "kvmem"


def error_dict(error: ApiError, flavor: Flavor, *, request_id: str) -> dict[str, object]:
    """``error`` in ``flavor``'s shape (also the payload of an in-stream error event)."""
    anthropic_type, openai_type = _TYPES[error.kind]
    if flavor == "anthropic":
        return {
            "type": "error",
            "error": {"type": anthropic_type, "message": error.message},
            "request_id": request_id,
        }
    if flavor == "openai":
        return {"error": {"message": error.message, "type": openai_type, "param": error.param, "code": error.code}}
    return {"error": {"type": error.kind, "message": error.message, "param": error.param, "code": error.code}}


def error_body(error: ApiError, flavor: Flavor, *, request_id: str) -> bytes:
    """The JSON body of ``error`` in ``flavor``'s shape."""
    return msgspec.json.encode(error_dict(error, flavor, request_id=request_id))


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """A request body msgspec rejected: malformed JSON, or a type/field/range error at a JSON path."""
    message = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _PATH.search(message)
        param = match.group("path").lstrip(".") if match else ""
        missing = _MISSING.search(message)
        if missing:  # the path names the object; the field is in the message
            param = f"{param}.{missing.group('field')}" if param else missing.group("field")
        return ApiError(400, "invalid_request", f"{param}: {message}" if param else message, param=param or None,
                        code="invalid_value")
    return ApiError(400, "invalid_request", f"the body is not valid JSON: {message}", code="invalid_json")


# An absolute path of two or more components (not a URL's: no scheme or host before it).
_SERVER_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"`,;()\[\]{}<>]+/)+(?P<name>[^\s/'\"`,;()\[\]{}<>]*)")
_ERRNO = re.compile(r"\[Errno (?P<errno>\d+)\]")


def without_server_paths(text: str) -> str:
    """``text`` with each absolute file path cut to its last name (``…/manifest.json``): an error a client
    reads says what failed, never where this server keeps its files. The server's log keeps the whole path."""
    return _SERVER_PATH.sub(lambda m: "…/" + m.group("name"), text)


DISK_CODES = frozenset({"insufficient_storage", "cache_dir_not_writable", "disk_error"})
"""The ``code`` of an error that :func:`from_exception` made of a disk failure."""


def _disk_error(kind: str, message: str) -> ApiError | None:
    """The HTTP error for an ``OSError`` (by its class name, its errno in the message) a runtime call met on
    disk: 507 when the disk is full, 503 when the cache directory cannot be written, else 500; None when
    ``kind`` is no ``OSError``."""
    cls = getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, OSError)):
        return None
    found = _ERRNO.search(message)
    code = int(found.group("errno")) if found else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ApiError(507, "api_error", f"the cache directory's disk is full ({os.strerror(code)})",
                        code="insufficient_storage")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return ApiError(503, "overloaded", f"the cache directory cannot be written ({os.strerror(code)})",
                        code="cache_dir_not_writable")
    reason = os.strerror(code) if code is not None else kind
    return ApiError(500, "api_error", f"the cache directory failed: {reason}", code="disk_error")


def from_exception(exc: Exception) -> ApiError:
    """The HTTP error for an exception a runtime call raised."""
    from actors.client import (
        TurnFailedError,  # trio-side import kept local: errors.py stays light
    )

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, msgspec.DecodeError):
        return from_decode_error(exc)
    if isinstance(exc, BudgetExceededError):
        return ApiError(400, "invalid_request", f"the prompt does not fit the KV memory budget: {exc}",
                        code="context_length_exceeded")
    if isinstance(exc, ContextLengthExceededError):  # OpenAI's code and param for the same refusal
        return ApiError(400, "invalid_request", str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, RecursionError):  # a structure nested in a string field (tool arguments, YAML)
        return ApiError(400, "invalid_request", "the request nests too deeply to be read", code="too_deeply_nested")
    if isinstance(exc, InvalidAgentIdError):
        return ApiError(400, "invalid_request", f"invalid agent id: {exc}", param="agent_id", code="invalid_agent_id")
    if isinstance(exc, ValueError):
        return ApiError(400, "invalid_request", str(exc))
    if isinstance(exc, ModelError):
        return ApiError(500, "api_error", f"model error: {exc}")
    if isinstance(exc, TurnFailedError):
        if exc.kind in ("Closed", "Cancelled"):
            return ApiError(503, "overloaded", "kvmem is shutting down")
        if exc.kind == "NotSaved":  # a durable turn (the default) whose cache did not reach the disk
            reason = without_server_paths(str(exc).removeprefix("NotSaved: "))
            found = _ERRNO.search(reason)
            disk = _disk_error("OSError", reason) if found else None
            return ApiError(disk.status if disk else 500, disk.kind if disk else "api_error",
                            f"the turn was generated but its cache could not be saved, so it is not answered "
                            f"(durable turns are the default; X-Kvmem-Durable: false answers without waiting "
                            f"for the disk): {reason}", code="cache_not_saved")
        disk = _disk_error(exc.kind, str(exc))
        if disk is not None:
            return disk
        if exc.kind == "AgentBusy":  # another node runs a turn of this agent (its lease in the shared tier)
            return ApiError(429, "rate_limit", str(exc).removeprefix("AgentBusy: "), code="agent_busy",
                            retry_after_s=1)
        if exc.kind.startswith("Template") or exc.kind == "UndefinedError":
            return ApiError(400, "invalid_request", f"the chat template cannot render these messages: {exc}")
    if isinstance(exc, OSError):
        disk = _disk_error(type(exc).__name__, str(exc))
        if disk is not None:
            return disk
    return ApiError(500, "api_error", without_server_paths(f"internal error: {type(exc).__name__}: {exc}"))


@contextmanager
def runtime_errors() -> Iterator[None]:
    """Turn exceptions of a runtime call into :class:`ApiError` (4xx for the client's mistakes)."""
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:
        raise from_exception(exc) from exc
