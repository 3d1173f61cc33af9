"""Reading a request's JSON object body, and its typed fields, with errors that name the field."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from engine_service.api.errors import ApiError


async def read_json_object(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as too_large:
        raise ApiError(413, "body_too_large", too_large.text or "request body too large") from None
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, "bad_json", f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "body must be a JSON object")
    return body


def parse_message(data: str) -> tuple[object, dict[str, Any]]:
    """One WebSocket text message: a JSON object, returned with its `type`."""
    try:
        message = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "bad_json", f"message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ApiError(400, "bad_json", "message must be a JSON object")
    return message.get("type"), message


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
