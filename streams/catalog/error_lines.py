"""error_lines.yaml: which lines each emitter prints at error level, and which of those are not faults.

Loaded and checked like the other catalogs: every pattern compiles, every entry's `example` (a line
its emitter prints, filled in from the format string the entry cites) matches its own pattern, and
ids are unique across the file.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.yamlsafe import YamlError, load_yaml
from streams.catalog import CATALOG_DIR, CatalogError, _Pattern


class _Entry(_Pattern):
    id: str = Field(pattern=r"^[a-z0-9_]+$")
    pattern: str
    source: str
    example: str

    @field_validator("pattern")
    @classmethod
    def _valid(cls, value: str) -> str:
        return cls._check(value)

    @model_validator(mode="after")
    def _example_matches(self) -> _Entry:
        if not re.search(self.pattern, self.example):
            raise ValueError(f"the example {self.example!r} does not match the pattern")
        return self


class ErrorLevel(_Entry):
    """A form of line this emitter prints at error (or warning) level."""


class NotFault(_Entry):
    """An error-level line of this emitter that is no fault: noise, or the run ended by its
    operator's or scheduler's decision (scancel, time limit, preemption, a signal to every rank)."""

    kind: Literal["noise", "ended_by_decision"]
    meaning: str


class Emitter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    emitter: str = Field(pattern=r"^[a-z0-9_]+$")
    version: str
    error_level: tuple[ErrorLevel, ...] = ()
    not_faults: tuple[NotFault, ...] = ()


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    emitters: tuple[Emitter, ...]


def load_error_lines(path: Path | None = None) -> tuple[Emitter, ...]:
    path = path or CATALOG_DIR / "error_lines.yaml"
    try:
        data = load_yaml(path.read_text(), str(path))
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    try:
        emitters = _File.model_validate(data).emitters
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise CatalogError(f"{path}: {where}: {err['msg']}") from None
    seen: set[str] = set()
    for em in emitters:
        for entry in (*em.error_level, *em.not_faults):
            if entry.id in seen:
                raise CatalogError(f"{path}: emitter {em.emitter}: duplicate id {entry.id!r}")
            seen.add(entry.id)
    return emitters


@lru_cache(maxsize=1)
def default_error_lines() -> tuple[Emitter, ...]:
    return load_error_lines()
