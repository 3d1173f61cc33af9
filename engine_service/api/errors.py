"""ApiError: every refusal the API gives, as one JSON body {"error": reason, "message": text} and a status.

`reason` is a stable machine word a client may branch on (bad_json, unknown_voice, text_too_long, ...);
`message` is for people and names the field at fault. Engine refusals (`SynthesisRefused`) map here once, so
the HTTP endpoints, jambonz's and the WebSockets' error messages agree. A 503 always carries Retry-After:
capacity comes back, and a client (or jambonz) should try again or elsewhere rather than wait on a socket.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType

import structlog
from aiohttp import web

from engines.base import (
    BadText,
    EmptyText,
    EngineUnavailable,
    NoCapacity,
    SynthesisRefused,
    TextTooLong,
    UnknownVoice,
    UnsupportedOption,
)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str,
                 headers: Mapping[str, str] = MappingProxyType({})) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.headers = dict(headers)

    def body(self) -> dict[str, str]:
        return {"error": self.reason, "message": self.message}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def unavailable(reason: str, message: str, retry_after_s: int) -> ApiError:
    return ApiError(503, reason, message, {"Retry-After": str(retry_after_s)})


# Most specific first: the classes form a hierarchy under SynthesisRefused.
_REFUSALS: tuple[tuple[type[SynthesisRefused], int, str], ...] = (
    (UnknownVoice, 400, "unknown_voice"),
    (EmptyText, 400, "empty_text"),
    (UnsupportedOption, 400, "unsupported_option"),
    (BadText, 400, "bad_text"),
    (TextTooLong, 413, "text_too_long"),
    (NoCapacity, 503, "at_capacity"),
    (EngineUnavailable, 503, "engine_unavailable"),
)


def refusal_error(refusal: SynthesisRefused, retry_after_s: int) -> ApiError:
    for kind, status, reason in _REFUSALS:
        if isinstance(refusal, kind):
            if status == 503:
                return unavailable(reason, str(refusal), retry_after_s)
            return ApiError(status, reason, str(refusal))
    return ApiError(400, "refused", str(refusal))


log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def answers_errors(handler: Handler) -> Handler:
    """Turn an ApiError raised before the response started into its JSON answer."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            # Capacity refusals matter to an operator; a stranger's bad requests only at debug (no log flood).
            # (A source past its failed keys is logged once per window by access.KeyFailures, not per request.)
            operator = (error.status == 429 and error.reason != "too_many_failed_keys") or error.status >= 500
            level = log.info if operator else log.debug
            level("tts_api_refused", path=request.path, status=error.status, reason=error.reason,
                  message=error.message[:200])
            return error.response()

    return wrapped


@web.middleware
async def json_route_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals of a path or method the API does not have, in the API's JSON shape."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(405, "method_not_allowed", f"{request.method} is not allowed on {request.path}; use {allowed}",
                        {"Allow": allowed}).response()
    except web.HTTPNotFound:
        return ApiError(404, "not_found", f"no route {request.path} (docs/TTS_API.md lists them)").response()
