"""One results format for every benchmark: bench/results/<benchmark>/<YYYY-MM-DD>-<commit>[-<variant>].json.

Each benchmark keeps writing its own report (PREFIX.json, PREFIX.md) and also calls `record` with
the figures and verdicts bench/figures.py takes from that report; `record` checks the result
against bench/results.schema.json before it writes anything. `python -m bench.render` makes
docs/benchmarks.md and the README's headline figures from these files.

No project imports beyond bench/: bench/fuzz.py records its result in the parent process only.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import numbers
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from schemas.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SCHEMA_PATH = Path(__file__).with_name("results.schema.json")
SCHEMA_VERSION = 1

Label = str | int | float | bool


class ResultError(UsageError, ValueError):
    """A result that does not follow bench/results.schema.json (or repeats a figure)."""


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    where: Mapping[str, Label] = field(default_factory=dict)
    description: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "value": self.value, "unit": self.unit}
        if self.where:
            out["where"] = dict(self.where)
        if self.description:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class Verdict:
    name: str
    passed: bool
    detail: str = ""
    where: Mapping[str, Label] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "passed": self.passed, "detail": self.detail}
        if self.where:
            out["where"] = dict(self.where)
        return out


@dataclass
class Summary:
    """What a benchmark's report says in the common format: how it ran, its figures, its verdicts."""

    parameters: dict[str, Any] = field(default_factory=dict)
    figures: list[Figure] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    def figure(
        self, name: str, value: float | None, unit: str, description: str | None = None, /, **where: Label
    ) -> None:
        """Add a figure; a value the run did not measure (None, NaN) is left out rather than written as 0."""
        if value is None or isinstance(value, bool):
            return
        # numpy scalars and the like as plain JSON numbers
        number = int(value) if isinstance(value, numbers.Integral) else float(value)
        if not math.isfinite(number):
            return  # NaN or infinity: not a measurement JSON can hold
        self.figures.append(Figure(name, number, unit, where, description))

    def verdict(self, name: str, passed: bool, detail: str = "", /, **where: Label) -> None:
        self.verdicts.append(Verdict(name, bool(passed), detail, where))


@cache
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return loaded


def errors(doc: Any) -> list[str]:
    """Everything wrong with a result: schema violations, then figures or verdicts named twice."""
    from jsonschema import Draft202012Validator

    found = [
        f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in sorted(Draft202012Validator(schema()).iter_errors(doc), key=lambda e: list(e.absolute_path))
    ]
    if found or not isinstance(doc, dict):
        return found
    for kind in ("figures", "verdicts"):
        seen: set[str] = set()
        for item in doc[kind]:
            key = json.dumps([item["name"], item.get("where", {})], sort_keys=True)
            if key in seen:
                found.append(f"{kind}: {item['name']!r} where {item.get('where', {})} appears twice")
            seen.add(key)
    return found


def validate(doc: Any) -> None:
    problems = errors(doc)
    if problems:
        raise ResultError("not a valid benchmark result:\n  " + "\n  ".join(problems))


def git_commit(repo: Path = REPO) -> str:
    """The short commit of the checkout, -dirty when a tracked file outside bench/results/ differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if changed else head or "unknown"


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def variant_name(prefix: str, default: str) -> str | None:
    """A report prefix as a result's variant: none for the benchmark's default prefix."""
    if prefix == default:
        return None
    name = re.sub(r"[^a-z0-9.-]+", "-", prefix.lower()).strip("-.")
    return name or None


def build(
    benchmark: str,
    summary: Summary,
    *,
    started: str,
    machine: Mapping[str, Any],
    commit: str | None = None,
    variant: str | None = None,
    report: str | None = None,
    notes: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": benchmark,
        **({"variant": variant} if variant else {}),
        "commit": commit or git_commit(),
        "started": started,
        "machine": dict(machine),
        "parameters": summary.parameters,
        "figures": [f.as_json() for f in summary.figures],
        "verdicts": [v.as_json() for v in summary.verdicts],
    }
    if report:
        doc["report"] = report
    if notes:
        doc["notes"] = notes
    if details is not None:
        doc["details"] = dict(details)
    return doc


def file_name(doc: Mapping[str, Any]) -> str:
    stem = f"{doc['started'][:10]}-{doc['commit']}"
    return stem + (f"-{doc['variant']}" if doc.get("variant") else "")


def write(doc: dict[str, Any], root: Path = RESULTS) -> Path:
    """Validate and write a result under root/<benchmark>/; a second run of the same day and commit gets -2, -3..."""
    validate(doc)
    folder = root / doc["benchmark"]
    folder.mkdir(parents=True, exist_ok=True)
    stem = file_name(doc)
    path = folder / f"{stem}.json"
    n = 2
    while path.exists():
        path = folder / f"{stem}-{n}.json"
        n += 1
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def _relative(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def record(
    benchmark: str,
    summary: Summary,
    *,
    root: Path,
    started: str,
    machine: Mapping[str, Any],
    details: Mapping[str, Any],
    variant: str | None = None,
    report: Path | None = None,
    notes: str | None = None,
) -> Path:
    """The one call every benchmark makes after writing its own report: the result in the common format,
    checked against the schema, under root/<benchmark>/ (root: the benchmark's --out folder)."""
    doc = build(
        benchmark,
        summary,
        started=started,
        machine=machine,
        variant=variant,
        report=_relative(report),
        notes=notes,
        details=details,
    )
    return write(doc, root)


@dataclass(frozen=True)
class Stored:
    """A result file as read back."""

    path: Path
    doc: dict[str, Any]

    @property
    def benchmark(self) -> str:
        return str(self.doc["benchmark"])

    @property
    def variant(self) -> str | None:
        v = self.doc.get("variant")
        return None if v is None else str(v)

    @property
    def quick(self) -> bool:
        return self.doc["parameters"].get("quick") is True

    @property
    def sort_key(self) -> tuple[str, str]:
        # A date alone sorts before the times of its day; the file name breaks ties (-2 after the first).
        return (str(self.doc["started"]), self.path.name)


def result_files(root: Path = RESULTS) -> list[Path]:
    return sorted(root.glob("*/*.json"))


def load(root: Path = RESULTS) -> list[Stored]:
    """Every result under root, oldest first."""
    return sorted((Stored(p, json.loads(p.read_text())) for p in result_files(root)), key=lambda s: s.sort_key)


def latest(results: Iterable[Stored], benchmark: str, *, with_quick: bool = False) -> Stored | None:
    """The newest result of a benchmark; a --quick run (a smoke test's size) only when asked for."""
    mine = [r for r in results if r.benchmark == benchmark and (with_quick or not r.quick)]
    return max(mine, key=lambda r: r.sort_key) if mine else None
