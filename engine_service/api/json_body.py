"""Reading a request's JSON object body, and its typed fields, with errors that name the field.

Hostile JSON is a 400 naming the problem, never a 500: a number longer than `MAX_NUMBER_CHARS` (Python refuses
ints over 4,300 digits with ValueError, and no field of ours needs more than a few), and nesting deeper than
`MAX_DEPTH` (every body and message of the API is one flat object; nesting past the parser's recursion limit
raises RecursionError, caught here too). The body's size is aiohttp's client_max_size (413)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from engine_service.api.errors import ApiError


MAX_DEPTH = 8  # arrays and objects inside one another
MAX_NUMBER_CHARS = 64


async def read_json_object(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as too_large:
        raise ApiError(413, "body_too_large", too_large.text or "request body too large") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "bad_json", f"body is not JSON: {exc}") from None
    return _json_object(text, "body")


def parse_message(data: str) -> tuple[object, dict[str, Any]]:
    """One WebSocket text message: a JSON object, returned with its `type`."""
    message = _json_object(data, "message")
    return message.get("type"), message


def _json_object(text: str, what: str) -> dict[str, Any]:
    too_deep = ApiError(400, "bad_json", f"{what} nests arrays or objects deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_int=_number(int), parse_float=_number(float))
    except json.JSONDecodeError as exc:
        raise ApiError(400, "bad_json", f"{what} is not JSON: {exc}") from None
    except RecursionError:  # the C parser's own limit, reached before ours could be checked
        raise too_deep from None
    if _nesting(value) > MAX_DEPTH:
        raise too_deep
    if not isinstance(value, dict):
        raise ApiError(400, "bad_json", f"{what} must be a JSON object")
    return value


def _number(kind: type):
    def parse(digits: str):
        if len(digits) > MAX_NUMBER_CHARS:
            raise ApiError(400, "bad_json", f"a number of {len(digits)} characters; at most {MAX_NUMBER_CHARS} "
                                            f"are accepted")
        return kind(digits)

    return parse


def _nesting(value: object) -> int:
    """How deep arrays and objects nest in a parsed value (iterative: no recursion limit of our own)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def string_field(body: dict[str, Any], name: str, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, "invalid_field", f"{name}: required")
        return None
    if not isinstance(value, str):
        raise ApiError(400, "invalid_field", f"{name}: must be a string")
    return value


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, "invalid_field", f"{name}: must be an integer")
    return value


def refuse_unknown_fields(body: dict[str, Any], known: tuple[str, ...]) -> None:
    """A typo ("sampleRate") must not silently fall back to a default."""
    if unknown := sorted(set(body) - set(known)):
        raise ApiError(400, "invalid_field", f"{unknown[0]}: unknown field; known: {', '.join(known)}")
