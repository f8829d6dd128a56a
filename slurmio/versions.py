"""Which data parser wrote a Slurm JSON document, and what that version promises.

Every ``--json`` document of squeue, sinfo, scontrol (and slurmrestd) names
its writer in ``meta``; the place moved between versions:

- 22.05: ``meta.plugin.type = "openapi/v0.0.38"``, ``meta.Slurm.version`` (ints)
- 23.02: ``meta.plugins.data_parser = "data_parser/v0.0.39"``, ``meta.Slurm``
- 23.11+: ``meta.plugin.data_parser = "data_parser/v0.0.4x"``, ``meta.slurm.version`` (strings)

The encodings each version uses for the fields slurmio reads are data
(``dataparsers.yaml``), loaded and checked once at import. A document from a
version not in that file, or with no version at all, is refused with
`SlurmFormatError` naming what was found: reading it with a guess would give
wrong values silently (``state="['RUNNING']"``, ``start_time=0``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.yamlsafe import YamlError, load_yaml
from slurmio.runners import SlurmCommandError

__all__ = [
    "DataParser",
    "SlurmFormatError",
    "detect",
    "known_versions",
    "load_document",
    "vocabulary",
]

_CATALOG = Path(__file__).with_name("dataparsers.yaml")

_ENCODINGS: dict[str, frozenset[str]] = {
    "job_state": frozenset({"string", "string_list"}),
    "job_times": frozenset({"integer", "number"}),
    "job_counts": frozenset({"integer", "number"}),
    "exit_code": frozenset({"wait_status", "wait_status_number", "process_exit"}),
    "node_state": frozenset({"string", "string_list"}),
    "node_reason_time": frozenset({"integer", "number"}),
    "sinfo": frozenset({"nodes", "groups"}),
}


class SlurmFormatError(SlurmCommandError, ValueError):
    """A Slurm document whose shape is not the one its data parser version promises.

    The message names the command, the field (a path like ``jobs[2].job_state``)
    and the version, so an unsupported Slurm is found at the first poll. It is a
    SlurmCommandError (the command's output is unusable) and a ValueError (bad input).
    """


@dataclass(frozen=True)
class DataParser:
    """One data parser version and the encodings it uses (see dataparsers.yaml)."""

    version: str  # "v0.0.42"
    slurm: str  # the Slurm release series that writes it by default: "24.11"
    job_state: str
    job_times: str
    job_counts: str
    exit_code: str
    node_state: str
    node_reason_time: str
    sinfo: str
    scontrol_json: bool
    release: str | None = None  # the writer's exact release when meta says it: "24.11.5"

    def with_release(self, release: str | None) -> DataParser:
        return self if release == self.release else DataParser(**{**self.__dict__, "release": release})


@dataclass(frozen=True)
class Vocabulary:
    job_base_states: frozenset[str]
    job_shown_flags: tuple[str, ...]
    node_base_states: frozenset[str]


def _load_catalog() -> tuple[dict[str, DataParser], Vocabulary]:
    try:
        raw = load_yaml(_CATALOG.read_text(), origin=str(_CATALOG))
    except (OSError, YamlError) as exc:
        raise RuntimeError(f"cannot load {_CATALOG}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("versions"), dict):
        raise RuntimeError(f"{_CATALOG}: expected a mapping with 'versions'")
    parsers: dict[str, DataParser] = {}
    for version, spec in raw["versions"].items():
        where = f"{_CATALOG.name}: versions.{version}"
        if not isinstance(spec, dict):
            raise RuntimeError(f"{where}: expected a mapping")
        fields: dict[str, Any] = {"version": str(version), "slurm": str(spec.get("slurm") or "")}
        if not fields["slurm"]:
            raise RuntimeError(f"{where}: 'slurm' (the release series) is missing")
        for key, allowed in _ENCODINGS.items():
            value = spec.get(key)
            if value not in allowed:
                raise RuntimeError(f"{where}.{key}: {value!r} is not one of {sorted(allowed)}")
            fields[key] = value
        if not isinstance(spec.get("scontrol_json"), bool):
            raise RuntimeError(f"{where}.scontrol_json: expected true or false")
        fields["scontrol_json"] = spec["scontrol_json"]
        unknown = set(spec) - set(_ENCODINGS) - {"slurm", "scontrol_json"}
        if unknown:
            raise RuntimeError(f"{where}: unknown keys {sorted(unknown)}")
        parsers[str(version)] = DataParser(**fields)

    def words(key: str) -> list[str]:
        value = raw.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(w, str) and w for w in value):
            raise RuntimeError(f"{_CATALOG.name}: {key}: expected a non-empty list of names")
        return [w.upper() for w in value]

    vocab = Vocabulary(
        job_base_states=frozenset(words("job_base_states")),
        job_shown_flags=tuple(words("job_shown_flags")),
        node_base_states=frozenset(words("node_base_states")),
    )
    return parsers, vocab


_PARSERS, _VOCAB = _load_catalog()
_BY_SERIES = {p.slurm: p for p in _PARSERS.values()}


def known_versions() -> dict[str, DataParser]:
    """Data parser version -> its description, for every version slurmio reads."""
    return dict(_PARSERS)


def vocabulary() -> Vocabulary:
    return _VOCAB


def detect(doc: Mapping[str, Any], what: str) -> DataParser:
    """The data parser that wrote ``doc`` (``what`` names the command in errors)."""
    meta = doc.get("meta")
    if not isinstance(meta, dict):
        raise SlurmFormatError(f"{what}: no 'meta' object, so the data parser version is unknown")
    release = _release(meta)
    named = _named_version(meta)
    if named is not None:
        parser = _PARSERS.get(named)
        if parser is None:
            raise SlurmFormatError(
                f"{what}: data parser {named} (Slurm {release or 'release unknown'}) is not supported; "
                f"slurmio reads {', '.join(sorted(_PARSERS))}"
            )
        return parser.with_release(release)
    if release is not None:
        series = ".".join(release.split(".")[:2])
        if series in _BY_SERIES:
            return _BY_SERIES[series].with_release(release)
        raise SlurmFormatError(f"{what}: Slurm {release} names no data parser and is not a known release series")
    raise SlurmFormatError(
        f"{what}: meta names neither a data parser (meta.plugin.data_parser, meta.plugins.data_parser, "
        f"meta.plugin.type) nor a Slurm version (meta.slurm / meta.Slurm)"
    )


def _named_version(meta: Mapping[str, Any]) -> str | None:
    for holder in ("plugin", "plugins"):
        plugin = meta.get(holder)
        if not isinstance(plugin, dict):
            continue
        for key in ("data_parser", "type"):
            value = plugin.get(key)
            if not isinstance(value, str) or "/" not in value:
                continue
            kind, _, version = value.partition("/")
            # 22.05 names its parser as the openapi plugin; 23.11+ slurmrestd says
            # type "openapi/slurmctld", which is no parser version.
            if kind in ("data_parser", "openapi") and version.startswith("v0.0."):
                return version
    return None


def _release(meta: Mapping[str, Any]) -> str | None:
    slurm = meta.get("slurm") if isinstance(meta.get("slurm"), dict) else meta.get("Slurm")
    if not isinstance(slurm, dict):
        return None
    release = slurm.get("release")
    if isinstance(release, str) and release:
        return release
    version = slurm.get("version")
    if isinstance(version, dict) and all(k in version for k in ("major", "minor")):
        try:
            return f"{int(version['major'])}.{int(version['minor']):02d}.{int(version.get('micro') or 0)}"
        except (TypeError, ValueError):
            return None
    return None


def load_document(text: str | bytes, what: str) -> dict[str, Any]:
    """Decode one Slurm ``--json`` document; Slurm's own ``errors`` raise SlurmCommandError."""
    try:
        data = json.loads(text)
    # JSONDecodeError is a ValueError; so is an integer past int()'s 4,300 digits.
    except ValueError as exc:
        raise SlurmFormatError(f"{what}: output is not JSON: {exc}") from exc
    except RecursionError:
        raise SlurmFormatError(f"{what}: output is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise SlurmFormatError(f"{what}: expected a JSON object, got {type(data).__name__}")
    errors = data.get("errors") or []
    if errors:
        raise SlurmCommandError(f"{what}: Slurm reported errors {errors!r}"[:1000])
    return data
