"""Load and validate the detector catalogs (data files, not code branches)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.vocab import Category, Role, Severity
from schemas.yamlsafe import YamlError, load_yaml

CATALOG_DIR = Path(__file__).parent


class CatalogError(ValueError):
    pass


class Signature(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9_]+$")
    pattern: str
    category: Category
    severity: Severity
    role: Role
    isolate: bool = False
    meaning: str
    source: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except (re.error, OverflowError, RecursionError) as exc:
            # re raises the latter two for huge repeat counts and very deep nesting.
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


Bucket = Literal["RESTART_APP", "RESET_GPU", "RESTART_BM", "IGNORE", "CONTACT_SUPPORT"]


class XidEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    xid: int = Field(ge=1)
    name: str
    meaning: str
    bucket: Bucket
    category: Category
    severity: Severity
    role: Role
    isolate: bool


def _load_list(path: Path) -> list[object]:
    try:
        data = load_yaml(path.read_text(), str(path))
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    if not isinstance(data, list):
        raise CatalogError(f"{path}: expected a list of entries")
    return data


def _validate(path: Path, model: type[BaseModel], key: str) -> list[BaseModel]:
    entries: list[BaseModel] = []
    seen: set[object] = set()
    for i, raw in enumerate(_load_list(path)):
        try:
            entry = model.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise CatalogError(f"{path}: entry {i}: field '{field}': {err['msg']}") from None
        ident = getattr(entry, key)
        if ident in seen:
            raise CatalogError(f"{path}: entry {i}: duplicate {key} {ident!r}")
        seen.add(ident)
        entries.append(entry)
    return entries


def load_signatures(path: Path | None = None) -> list[Signature]:
    return [e for e in _validate(path or CATALOG_DIR / "signatures.yaml", Signature, "id") if isinstance(e, Signature)]


def load_xids(path: Path | None = None) -> dict[int, XidEntry]:
    entries = _validate(path or CATALOG_DIR / "xid.yaml", XidEntry, "xid")
    return {e.xid: e for e in entries if isinstance(e, XidEntry)}


@lru_cache(maxsize=1)
def default_signatures() -> tuple[Signature, ...]:
    return tuple(load_signatures())


@lru_cache(maxsize=1)
def default_xids() -> dict[int, XidEntry]:
    return load_xids()
