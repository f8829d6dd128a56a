"""Reading one record's fields in the encoding its data parser version promises.

A `Fields` wraps one JSON object (a job, a node, an sinfo group) with the
document's `DataParser`; each getter takes the field name and the encoding
and raises `SlurmFormatError` naming command, field path, version and what
was found when the value has another shape. Absent optional fields give None.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slurmio.records import ExitStatus
from slurmio.versions import DataParser, SlurmFormatError

__all__ = ["Fields", "opt_text"]

# Slurm's ways of saying "nothing here".
_EMPTY = ("", "(null)", "None", "N/A", "none")


def opt_text(value: object) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return None if text in _EMPTY else text


def _kind(value: object) -> str:
    if value is None:
        return "nothing (null or absent)"
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:6]}"
    return f"{type(value).__name__} {repr(value)[:80]}"


class Fields:
    def __init__(self, record: Mapping[str, Any], parser: DataParser, what: str, path: str) -> None:
        self.record = record
        self.parser = parser
        self.what = what
        self.path = path

    def fail(self, name: str, expected: str, value: object) -> SlurmFormatError:
        writer = f"data parser {self.parser.version}" + (
            f", Slurm {self.parser.release}" if self.parser.release else ""
        )
        return SlurmFormatError(
            f"{self.what} ({writer}): field {self.path}.{name}: expected {expected}, got {_kind(value)}"
        )

    def has(self, name: str) -> bool:
        return self.record.get(name) is not None

    def required(self, name: str) -> Any:
        if self.record.get(name) is None:
            raise self.fail(name, "a value (the field is required)", None)
        return self.record[name]

    # ---- plain JSON types
    def text(self, name: str) -> str | None:
        value = self.record.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(name, "a string", value)
        return opt_text(value)

    def integer(self, name: str) -> int | None:
        value = self.record.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, "an integer", value)
        return value

    def string_list(self, name: str) -> tuple[str, ...]:
        value = self.record.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(name, "a list of strings", value)
        return tuple(value)

    def mapping(self, name: str) -> Fields | None:
        value = self.record.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(name, "an object", value)
        return Fields(value, self.parser, self.what, f"{self.path}.{name}")

    # ---- version-dependent encodings (dataparsers.yaml)
    def number(self, name: str, encoding: str) -> int | None:
        """An ``integer``, or a ``number`` object ({set, infinite, number}) -> int; None if unset/infinite."""
        if encoding == "integer":
            return self.integer(name)
        value = self.record.get(name)
        if value is None:
            return None
        if not (isinstance(value, dict) and {"set", "infinite", "number"} <= set(value)):
            raise self.fail(name, "a {set, infinite, number} object", value)
        if value["set"] is not True or value["infinite"] is True:
            return None
        number = value["number"]
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise self.fail(f"{name}.number", "a number", number)
        return int(number)

    def state_words(self, name: str, encoding: str) -> tuple[str, ...]:
        """A state as upper-case words: ``"idle"`` / ``"IDLE+DRAIN"`` (string) or ``["IDLE", "DRAIN"]``."""
        if encoding == "string":
            value = self.record.get(name)
            if not isinstance(value, str) or not value.strip():
                raise self.fail(name, "a state string", value)
            return tuple(w for w in value.strip().upper().split("+") if w)
        words = self.string_list(name)
        if not words:
            raise self.fail(name, "a non-empty list of state names", self.record.get(name))
        return tuple(w.upper() for w in words)

    def exit_status(self, name: str, encoding: str) -> ExitStatus | None:
        if encoding in ("wait_status", "wait_status_number"):
            status = self.integer(name) if encoding == "wait_status" else self.number(name, "number")
            return None if status is None else ExitStatus.from_wait_status(status)
        value = self.mapping(name)
        if value is None:
            return None
        if not value.has("return_code"):
            raise self.fail(name, "a {status, return_code, signal} object", self.record.get(name))
        signal = value.mapping("signal")
        return ExitStatus(
            return_code=value.number("return_code", "number"),
            signal=signal.number("id", "number") if signal is not None else None,
        )
