"""Load and validate the detector catalogs (data files, not code branches)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.errors import ConfigError
from schemas.vocab import ActionKind, Category, Role, Severity
from schemas.yamlsafe import YamlError, load_yaml

CATALOG_DIR = Path(__file__).parent


class CatalogError(ConfigError, ValueError):
    pass


M = TypeVar("M", bound=BaseModel)

#: Where an interconnect fault lives (issue 42, deliverable 5): `node_local` - NVLink/NVSwitch on the
#: node, the node's own adapter or port, a GPU pair on one node: the node that reports it is at fault;
#: `fabric` - a link between two peers, the switches, a collective that timed out: no one node is.
Locality = Literal["node_local", "fabric"]
#: The categories whose entries must say their locality.
LOCALITY_CATEGORIES: tuple[Category, ...] = ("interconnect",)


def check_locality(category: Category, isolate: bool, locality: Locality | None) -> None:
    """An interconnect entry says its locality, and its `isolate` follows from it: only a node-local
    fault takes its node out (the policy then drains it only when the evidence names the node)."""
    if locality is None:
        if category in LOCALITY_CATEGORIES:
            raise ValueError(f"an entry of category {category} needs locality: node_local or fabric")
        return
    if isolate != (locality == "node_local"):
        raise ValueError(
            f"locality {locality} with isolate {str(isolate).lower()}: isolate is true exactly when node_local"
        )


class Signature(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9_]+$")
    pattern: str
    category: Category
    severity: Severity
    role: Role
    isolate: bool = False
    # node_local or fabric: required for interconnect entries (check_locality).
    locality: Locality | None = None
    meaning: str
    source: str
    # A catch-all (a bare exit code, any Python exception): tried after every specific entry of this
    # file and of the emitters' vocabularies (vocabulary.yaml), so that any of those wins a line it names.
    fallback: bool = False

    @model_validator(mode="after")
    def _located(self) -> Signature:
        check_locality(self.category, self.isolate, self.locality)
        return self

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except (re.error, OverflowError, RecursionError) as exc:
            # re raises the latter two for huge repeat counts and very deep nesting.
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class SeverityOverride(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    severity: Severity
    role: Role
    isolate: bool


class XidBucket(BaseModel):
    """What trainmedic does with one of NVIDIA's Immediate Action buckets (xid.yaml `buckets`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bucket: str = Field(pattern=r"^[A-Z0-9_]+$")
    severity: Severity
    role: Role
    isolate: bool
    emit: bool  # false: NVIDIA says no action (IGNORE, follow-on Xids), so no anomaly
    actions: tuple[ActionKind, ...] = Field(min_length=1)  # what a code of this bucket may lead to
    guidance: str
    when_fatal: SeverityOverride | None = None  # the Xid line says "Fatal" (NVLink5 Xids 144-150)
    when_nonfatal: SeverityOverride | None = None  # ... or "Nonfatal"


class _XidRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    xid: int = Field(ge=1)
    name: str = Field(min_length=1)
    meaning: str = Field(min_length=1)
    bucket: str
    investigate: str = ""
    category: Category


class XidEntry(BaseModel):
    """One Xid with its bucket resolved: what the detector and attribution read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    xid: int = Field(ge=1)
    name: str
    meaning: str
    bucket: str
    category: Category
    severity: Severity
    role: Role
    isolate: bool
    emit: bool = True
    investigate: str = ""


@dataclass(frozen=True)
class XidCatalog:
    buckets: dict[str, XidBucket]
    xids: dict[int, XidEntry]


class SxidBucket(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bucket: str = Field(pattern=r"^[A-Z0-9_]+$")
    emit: bool  # false: a non-fatal SXid of this bucket raises no anomaly
    guidance: str


class SxidEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sxid: int = Field(ge=1)
    name: str  # NVSWITCH_ERR_HW_*; empty where NVIDIA's table has none (28006)
    bucket: str
    fatal: bool  # the catalog's FATAL/NONFATAL column: used when the line itself does not say


@dataclass(frozen=True)
class SxidCatalog:
    buckets: dict[str, SxidBucket]
    sxids: dict[int, SxidEntry]


class _Pattern(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @staticmethod
    def _check(value: str) -> str:
        try:
            re.compile(value)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class KernelHeader(_Pattern):
    id: str = Field(pattern=r"^[a-z0-9_]+$")
    pattern: str
    meaning: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        value = cls._check(value)
        if not {"task", "pid"} <= set(re.compile(value).groupindex):
            raise ValueError("needs named groups 'task' and 'pid'")
        return value


class Filesystem(_Pattern):
    id: str = Field(pattern=r"^[a-z0-9_]+$")
    name: str
    frame: str
    source: str

    @field_validator("frame")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return cls._check(value)


class ReportVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    category: Category
    severity: Severity
    role: Role


class ReportLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_frames: int = Field(ge=1, le=10_000)
    window_s: float = Field(gt=0, le=3600)
    max_nodes: int = Field(ge=1, le=1_000_000)
    storage: ReportVerdict
    no_filesystem: ReportVerdict


class KernelSignatures(_Pattern):
    headers: tuple[KernelHeader, ...] = Field(min_length=1)
    frame: str
    report: ReportLimits
    filesystems: tuple[Filesystem, ...] = Field(min_length=1)

    @field_validator("frame")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return cls._check(value)


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


def _load_mapping(path: Path, sections: tuple[str, ...]) -> dict[str, Any]:
    try:
        data = load_yaml(path.read_text(), str(path))
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    if not isinstance(data, dict) or set(data) != set(sections):
        raise CatalogError(f"{path}: expected exactly the sections {', '.join(sections)}")
    for name in sections:
        if not isinstance(data[name], list):
            raise CatalogError(f"{path}: section '{name}': expected a list of entries")
    return data


def _rows(path: Path, section: str, raws: list[object], model: type[M], key: str) -> list[M]:
    """Validate one section's rows; an error names the file, section, row and (when known) its key."""
    rows: list[M] = []
    seen: set[object] = set()
    for i, raw in enumerate(raws):
        where = f"{path}: {section} entry {i}"
        if isinstance(raw, dict) and key in raw:
            where += f" ({key} {raw[key]!r})"
        try:
            row = model.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise CatalogError(f"{where}: field '{field}': {err['msg']}") from None
        ident = getattr(row, key)
        if ident in seen:
            raise CatalogError(f"{where}: duplicate {key} {ident!r}")
        seen.add(ident)
        rows.append(row)
    return rows


def load_xid_catalog(path: Path | None = None) -> XidCatalog:
    """xid.yaml: the bucket table and every Xid, each resolved through its bucket."""
    path = path or CATALOG_DIR / "xid.yaml"
    data = _load_mapping(path, ("buckets", "xids"))
    buckets = {b.bucket: b for b in _rows(path, "buckets", data["buckets"], XidBucket, "bucket")}
    xids: dict[int, XidEntry] = {}
    for i, row in enumerate(_rows(path, "xids", data["xids"], _XidRow, "xid")):
        b = buckets.get(row.bucket)
        if b is None:
            raise CatalogError(f"{path}: xids entry {i} (xid {row.xid}): bucket {row.bucket!r} has no row in 'buckets'")
        xids[row.xid] = XidEntry(
            xid=row.xid,
            name=row.name,
            meaning=row.meaning,
            bucket=row.bucket,
            category=row.category,
            severity=b.severity,
            role=b.role,
            isolate=b.isolate,
            emit=b.emit,
            investigate=row.investigate,
        )
    unused = sorted(set(buckets) - {e.bucket for e in xids.values()})
    if unused:
        raise CatalogError(f"{path}: buckets {', '.join(unused)} are used by no Xid")
    return XidCatalog(buckets=buckets, xids=xids)


def load_xids(path: Path | None = None) -> dict[int, XidEntry]:
    return load_xid_catalog(path).xids


def load_sxid_catalog(path: Path | None = None) -> SxidCatalog:
    path = path or CATALOG_DIR / "sxid.yaml"
    data = _load_mapping(path, ("buckets", "sxids"))
    buckets = {b.bucket: b for b in _rows(path, "buckets", data["buckets"], SxidBucket, "bucket")}
    sxids: dict[int, SxidEntry] = {}
    for i, row in enumerate(_rows(path, "sxids", data["sxids"], SxidEntry, "sxid")):
        if row.bucket not in buckets:
            raise CatalogError(
                f"{path}: sxids entry {i} (sxid {row.sxid}): bucket {row.bucket!r} has no row in 'buckets'"
            )
        sxids[row.sxid] = row
    unused = sorted(set(buckets) - {e.bucket for e in sxids.values()})
    if unused:
        raise CatalogError(f"{path}: buckets {', '.join(unused)} are used by no SXid")
    return SxidCatalog(buckets=buckets, sxids=sxids)


def load_catalog_model(path: Path, model: type[M]) -> M:
    """A catalog file read as `model`; CatalogError naming the file and the first bad field."""
    try:
        data = load_yaml(path.read_text(), str(path))
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise CatalogError(f"{path}: field '{field}': {err['msg']}") from None


def load_kernel_signatures(path: Path | None = None) -> KernelSignatures:
    path = path or CATALOG_DIR / "kernel_signatures.yaml"
    sigs = load_catalog_model(path, KernelSignatures)
    for section, ids in (("headers", [h.id for h in sigs.headers]), ("filesystems", [f.id for f in sigs.filesystems])):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise CatalogError(f"{path}: {section}: duplicate id {', '.join(dupes)}")
    return sigs


@lru_cache(maxsize=1)
def default_signatures() -> tuple[Signature, ...]:
    return tuple(load_signatures())


@lru_cache(maxsize=1)
def default_xids() -> dict[int, XidEntry]:
    return load_xids()


@lru_cache(maxsize=1)
def default_xid_catalog() -> XidCatalog:
    """xid.yaml as shipped, read once per process (an XidDetector is built per offline diagnosis)."""
    return load_xid_catalog()


@lru_cache(maxsize=1)
def default_sxids() -> SxidCatalog:
    return load_sxid_catalog()


@lru_cache(maxsize=1)
def default_kernel_signatures() -> KernelSignatures:
    return load_kernel_signatures()
