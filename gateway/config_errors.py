"""How a configuration mistake is worded: one 'key.path: problem' line per mistake, in `ConfigError`.

Pydantic locates a bad value by its field; checks that span fields or the whole file mark their
messages so the line still names the right key:
- `FieldProblem(field, message)` (a cross-field check in a section) -> `section.field: message`;
- a message starting with `@@` (whole-file reference checks, an engine's own settings check) holds
  finished 'key: problem' lines, one per line, passed through as they are.
`describe()` turns a `ValidationError` into those lines. Nothing here knows which sections exist.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError


class ConfigError(ValueError):
    """The configuration cannot be used; `errors` holds one 'key.path: problem' line per mistake."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(self.errors))


class FieldProblem(ValueError):
    """Raised by cross-field checks so the message names the field, not only its section."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"@{field}: {message}")


def _key_path(location: Sequence[str | int]) -> str:
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


def describe(exc: ValidationError) -> list[str]:
    """The 'key.path: problem' lines for a failed validation, in pydantic's order."""
    lines: list[str] = []
    for error in exc.errors(include_url=False):
        location = [part for part in error["loc"] if part not in ("function-after", "function-plain")]
        message = error["msg"].removeprefix("Value error, ")
        if message.startswith("@@"):  # whole-config reference checks: already 'key: problem' lines
            lines += message[2:].split("\n")
            continue
        if message.startswith("@"):  # a cross-field check naming its field
            field, _, message = message[1:].partition(": ")
            location.append(field)
        elif error["type"] == "extra_forbidden":
            message = "unknown field"
        elif error["type"] == "missing":
            message = "required field is missing"
        lines.append(f"{_key_path(location)}: {message}")
    return lines
