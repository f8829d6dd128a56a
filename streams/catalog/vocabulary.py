"""vocabulary.yaml: the emitters' own failure messages, each classed, as log signatures.

An entry carries the emitter's format string, a pattern, the source file at a pinned version and an
example filled in from the format. Loading checks that the pattern compiles, that the format (read as
a regex, `format_regex`) and the pattern both match the example, that every entry's class exists and
every class is used, and that ids are unique. `vocabulary_signatures` turns the entries into
`Signature`s (the class gives category, severity, role and isolate), which the log-signature detector
orders with signatures.yaml's through `detector_order`. `catalog_tables` writes docs/catalogs.md's tables
(emitter, version, entries, how derived, gaps; classes) from the same file.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.vocab import ActionKind, Category, Role, Severity
from streams.catalog import CATALOG_DIR, CatalogError, Locality, Signature, _Pattern, check_locality, load_catalog_model

# printf conversions (flags, width, precision, length) and Python format fields; everything else in
# a format is literal text.
_PRINTF = re.compile(r"%[-+ #0]*(?:\d+|\*)?(?:\.\d+)?(?:hh|h|ll|l|L|z|j|t)?([diouxXeEfgGcsp%])")
_PY_FIELD = re.compile(r"\{[^{}]*\}")
_CONVERSION = {"s": r".*?", "p": r"\S+", "c": r"."}
_NUMBER = r"[-+]?(?:0x)?[0-9a-fA-F.]+"


def format_regex(fmt: str) -> re.Pattern[str]:
    """The format string as a regex: literal text escaped, each conversion or field a wildcard."""
    out: list[str] = []
    pos = 0
    for m in sorted([*_PRINTF.finditer(fmt), *_PY_FIELD.finditer(fmt)], key=lambda m: m.start()):
        if m.start() < pos:
            continue
        out.append(re.escape(fmt[pos : m.start()]))
        if m.re is _PY_FIELD:
            out.append(r".*?")
        else:
            conv = m.group(1)
            out.append("%" if conv == "%" else _CONVERSION.get(conv, _NUMBER))
        pos = m.end()
    out.append(re.escape(fmt[pos:]))
    return re.compile("".join(out))


class VocabularyClass(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(alias="class", pattern=r"^[a-z0-9_]+$")
    category: Category
    severity: Severity
    role: Role
    isolate: bool
    # node_local or fabric: required for interconnect classes (streams.catalog.check_locality).
    locality: Locality | None = None
    action: ActionKind  # what the default policy decides for this category and isolation (held by a test)
    meaning: str = Field(min_length=1)

    @model_validator(mode="after")
    def _located(self) -> VocabularyClass:
        check_locality(self.category, self.isolate, self.locality)
        return self


class VocabularyEntry(_Pattern):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: str = Field(pattern=r"^[a-z0-9_]+$")
    klass: str = Field(alias="class")
    format: str = Field(min_length=1)
    pattern: str
    source: str = Field(pattern=r"^https://")
    example: str
    meaning: str = ""
    fallback: bool = False

    @field_validator("pattern")
    @classmethod
    def _valid(cls, value: str) -> str:
        return cls._check(value)

    @model_validator(mode="after")
    def _example_fits(self) -> VocabularyEntry:
        if not format_regex(self.format).search(self.example):
            raise ValueError(f"the example {self.example!r} is not an instance of the format {self.format!r}")
        if not re.search(self.pattern, self.example):
            raise ValueError(f"the example {self.example!r} does not match the pattern")
        return self


class Emitter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    emitter: str = Field(pattern=r"^[a-z0-9_]+$")
    version: str = Field(min_length=1)
    # For docs/catalogs.md's table: how the entries were read from the emitter, and what could not be.
    derived: str = ""
    gaps: str = ""
    entries: tuple[VocabularyEntry, ...] = Field(min_length=1)


class Vocabulary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: tuple[VocabularyClass, ...] = Field(min_length=1)
    emitters: tuple[Emitter, ...] = Field(min_length=1)

    def entries(self) -> Iterable[tuple[Emitter, VocabularyEntry]]:
        for em in self.emitters:
            for entry in em.entries:
                yield em, entry

    def class_of(self, entry: VocabularyEntry) -> VocabularyClass:
        return next(c for c in self.classes if c.name == entry.klass)


def load_vocabulary(path: Path | None = None) -> Vocabulary:
    path = path or CATALOG_DIR / "vocabulary.yaml"
    vocab = load_catalog_model(path, Vocabulary)
    names = [c.name for c in vocab.classes]
    if len(set(names)) != len(names):
        raise CatalogError(f"{path}: classes: duplicate class {sorted({n for n in names if names.count(n) > 1})}")
    seen: set[str] = set()
    used: set[str] = set()
    for em, entry in vocab.entries():
        if entry.id in seen:
            raise CatalogError(f"{path}: emitter {em.emitter}: duplicate id {entry.id!r}")
        if entry.klass not in names:
            raise CatalogError(f"{path}: emitter {em.emitter}: entry {entry.id}: no class {entry.klass!r}")
        seen.add(entry.id)
        used.add(entry.klass)
    unused = sorted(set(names) - used)
    if unused:
        raise CatalogError(f"{path}: classes used by no entry: {', '.join(unused)}")
    return vocab


def vocabulary_signatures(vocab: Vocabulary) -> tuple[Signature, ...]:
    out = []
    for _em, entry in vocab.entries():
        klass = vocab.class_of(entry)
        out.append(
            Signature(
                id=entry.id,
                pattern=entry.pattern,
                category=klass.category,
                severity=klass.severity,
                role=klass.role,
                isolate=klass.isolate,
                locality=klass.locality,
                meaning=entry.meaning or klass.meaning,
                source=entry.source,
                fallback=entry.fallback,
            )
        )
    return tuple(out)


def detector_order(signatures: Sequence[Signature], vocabulary: Sequence[Signature]) -> list[Signature]:
    """The order the detector tries entries in (first match wins): the specific entries of
    signatures.yaml, then the vocabulary's, then the fallbacks of each. An id both have is taken from
    signatures.yaml only (a catalog passed in with vocabulary entries already in it stays as it is)."""
    own = {s.id for s in signatures}
    vocab = [v for v in vocabulary if v.id not in own]
    return [
        *(s for s in signatures if not s.fallback),
        *(v for v in vocab if not v.fallback),
        *(s for s in signatures if s.fallback),
        *(v for v in vocab if v.fallback),
    ]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"


def catalog_tables(vocab: Vocabulary) -> str:
    """docs/catalogs.md's tables of the vocabulary: one row per emitter block (version, entries, how derived,
    gaps) and one per class (what it decides, how many entries). The doc holds this text verbatim between
    its `vocabulary-tables` markers; tests/unit/test_vocabulary.py fails when the two drift apart."""
    rows = [
        "| emitter | version | entries | how derived | gaps |",
        "|---|---|---|---|---|",
        *(
            f"| {em.emitter} | {_cell(em.version)} | {len(em.entries)} | {_cell(em.derived)} | {_cell(em.gaps)} |"
            for em in vocab.emitters
        ),
        "",
        "| class | category | role | isolate | default policy's action | entries |",
        "|---|---|---|---|---|---|",
    ]
    counts = Counter(entry.klass for _em, entry in vocab.entries())
    rows += [
        f"| {c.name} | {c.category} | {c.role} | {'yes' if c.isolate else 'no'} | {c.action} | {counts[c.name]} |"
        for c in vocab.classes
    ]
    total = sum(counts.values())
    rows += ["", f"{total} entries from {len(vocab.emitters)} emitter blocks in {len(vocab.classes)} classes."]
    return "\n".join(rows) + "\n"


@lru_cache(maxsize=1)
def default_vocabulary() -> Vocabulary:
    return load_vocabulary()


@lru_cache(maxsize=1)
def default_vocabulary_signatures() -> tuple[Signature, ...]:
    return vocabulary_signatures(default_vocabulary())


if __name__ == "__main__":
    # Regenerates docs/catalogs.md's vocabulary tables: paste the output between the markers.
    print(catalog_tables(default_vocabulary()), end="")
