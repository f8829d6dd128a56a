"""orjson serialization with typed, field-naming decode errors.

Encode writes the current schema version; decode also reads the previous one,
upgraded first (schemas/upgrade.py, docs/schemas.md).
"""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import ValidationError

from schemas.errors import UsageError
from schemas.events import SCHEMA_VERSION, Event
from schemas.upgrade import ACCEPTED_VERSIONS, UpgradeError, upgrade

E = TypeVar("E", bound=Event)


class DecodeError(UsageError, ValueError):
    """A payload that is not a valid event; `field` names where, `problem` what."""

    def __init__(self, event_type: str, field: str, problem: str) -> None:
        self.event_type = event_type
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {event_type}: field '{field}': {problem}")


def encode(event: Event) -> bytes:
    return orjson.dumps(event.model_dump(mode="json"))


def decode(event_type: type[E], payload: bytes | str) -> E:
    return _decode(event_type, payload)[0]


def decode_as_read(event_type: type[E], payload: bytes) -> tuple[E, bytes]:
    """The event, and a current-version payload of it: `payload` itself when it already was one
    (what a consumer passes on unchanged, with no second encode), else the upgraded event encoded."""
    event, upgraded = _decode(event_type, payload)
    return event, encode(event) if upgraded else payload


def _decode(event_type: type[E], payload: bytes | str) -> tuple[E, bool]:
    """(the event, whether it was upgraded from an older version)."""
    name = event_type.type_name
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(name, "<payload>", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DecodeError(name, "<payload>", f"expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    # bool is an int subclass (and 1.0 == 1): `true` must not pass for version 1.
    if type(version) is not int or version not in ACCEPTED_VERSIONS:
        accepted = " and ".join(map(str, ACCEPTED_VERSIONS))
        raise DecodeError(name, "schema_version", f"unsupported version {version!r} (accepted: {accepted})")
    if version != SCHEMA_VERSION:
        try:
            data = upgrade(name, data)
        except UpgradeError as exc:
            raise DecodeError(name, exc.field, f"{exc.problem} (a version {version} payload)") from None
    try:
        return event_type.model_validate(data), version != SCHEMA_VERSION
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<payload>"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise DecodeError(name, field, f"{err['msg']}{more}") from None
