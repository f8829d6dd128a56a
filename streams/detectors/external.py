"""External health detector: NVSentinel and NVRx verdicts (topic health.external) -> anomalies.

producers/ingest.py turns what other monitors report into `schemas.events.HealthEvent`; this pure
detector classifies each one through streams/catalog/external_health.yaml (data, cited there):

- **NVSentinel** (``origin`` nvsentinel; github.com/NVIDIA/NVSentinel,
  data-models/protobufs/health_event.proto): an anomaly ON THE NODE (``job_id`` None: attribution maps a
  node to its running job), source ``external``, role root.

  - A recovery (``is_healthy``) yields nothing.
  - An Xid check (syslog-health-monitor's SysLogsXIDError: ``error_codes`` ["79"]; "XID_ERROR_48" /
    "XID-48" of NVSentinel's docs/DATA_FLOW.md; SysLogsGPUFallenOff = Xid 79) yields signature
    ``xid_<code>`` classified through xid.yaml exactly as `streams.detectors.xid.XidDetector` classifies
    the kernel's line, so the two sources' reports of one Xid on one node merge downstream.
  - An SXid check yields ``sxid_<code>`` as `streams.detectors.xid.SxidDetector` does.
  - Other checks: ``nvsentinel_<check name lowercased>``; fatal -> critical, isolate when both the check's
    entry and the recommended action say so; not fatal -> warning, no isolate; a check the catalog does not
    list -> warning, no isolate, category by component class.
  - ``[STORE_ONLY]`` (NVSentinel's processingStrategy "observe, do not act"): warning at most, never isolate.

- **NVRx** (``origin`` nvrx; github.com/NVIDIA/nvidia-resiliency-ext): an anomaly ON THE JOB (``job_id``,
  ``node``, ``rank``). Our report shape mirrors NVRx's straggler ``Report``
  (src/nvidia_resiliency_ext/attribution/straggler/reporting.py: gpu_relative_perf_scores,
  gpu_individual_perf_scores, section_relative_perf_scores, section_individual_perf_scores; formerly
  src/nvidia_resiliency_ext/straggler/reporting.py) and the fault tolerance rank monitor's failure kinds
  (src/nvidia_resiliency_ext/fault_tolerance/config.py: initial_rank_heartbeat_timeout,
  rank_heartbeat_timeout, rank_section_timeouts, rank_out_of_section_timeout; rank_monitor_server.py:
  heartbeat and section timeouts, unhealthy node / NIC), which are accepted as ``fault_type`` beside our
  short names (hang, rank_failure, ...).

  - ``nvrx_fault``: error_codes[0] is the fault type, looked up in the catalog (a hang: category hang,
    role root; a rank that died: a crash marker, category unknown, role collateral, so that the cause
    found elsewhere wins); unknown types: category unknown, warning.
  - ``nvrx_straggler`` not healthy: signature ``straggler`` as streams/detectors/straggler.py (category
    node, warning, root, isolate).

Every anomaly's id is ``stable_id("anm", event.event_id, signature)``: a redelivered event yields the same
anomaly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.events import Anomaly, HealthEvent, external_provenance
from schemas.ids import stable_id
from schemas.vocab import SEVERITY_RANK, Category, Role, Severity
from schemas.yamlsafe import YamlError, load_yaml
from streams.catalog import CATALOG_DIR, CatalogError, XidBucket, XidCatalog, XidEntry, load_xid_catalog
from streams.detectors.xid import judge_xid

__all__ = [
    "ExternalHealthCatalog",
    "ExternalHealthDetector",
    "load_external_health_catalog",
]

STORE_ONLY_MARK = " [STORE_ONLY]"  # what producers/ingest.py appends for processingStrategy STORE_ONLY
_LINE_MAX = 2000
_MEANING_MAX = 4000
_NUMBER = re.compile(r"^[0-9]{1,6}$")
_SIG_CHARS = re.compile(r"[^a-z0-9_]+")


# --------------------------------------------------------------------- catalog
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _regex(value: str) -> str:
    try:
        compiled = re.compile(value)
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    if "code" not in compiled.groupindex:
        raise ValueError("needs a named group 'code'")
    return value


class FallenOffBus(_Strict):
    checks: tuple[str, ...] = Field(min_length=1)
    codes: tuple[str, ...] = Field(min_length=1)
    xid: int = Field(ge=1)


class XidChecks(_Strict):
    checks: tuple[str, ...] = Field(min_length=1)
    check_pattern: str
    code_pattern: str
    fallen_off_bus: FallenOffBus

    @field_validator("check_pattern", "code_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return _regex(value)


class SxidChecks(_Strict):
    checks: tuple[str, ...] = Field(min_length=1)


class ActionRule(_Strict):
    action: str = Field(pattern=r"^[A-Z0-9_]+$")
    isolate: bool
    meaning: str = Field(min_length=1)


class ComponentRule(_Strict):
    component: str = Field(min_length=1)
    category: Category


class CheckRule(_Strict):
    check: str = Field(min_length=1, max_length=256)
    signature: str | None = Field(default=None, pattern=r"^[a-z0-9_]+$", max_length=64)
    category: Category
    isolate: bool  # when the event is fatal (and the recommended action allows it)
    meaning: str = Field(min_length=1)


class NVSentinelRules(_Strict):
    xid: XidChecks
    sxid: SxidChecks
    gpu_entity_types: tuple[str, ...]
    actions: tuple[ActionRule, ...]
    components: tuple[ComponentRule, ...]
    default_category: Category
    checks: tuple[CheckRule, ...]


class FaultRule(_Strict):
    fault: str = Field(pattern=r"^[a-z0-9_]+$")
    aliases: tuple[str, ...] = ()
    signature: str = Field(pattern=r"^[a-z0-9_]+$", max_length=64)
    category: Category
    severity: Severity
    role: Role
    isolate: bool
    meaning: str = Field(min_length=1)


class Verdict(_Strict):
    category: Category
    severity: Severity
    role: Role


class StragglerRule(_Strict):
    signature: str = Field(pattern=r"^[a-z0-9_]+$", max_length=64)
    category: Category
    severity: Severity
    role: Role
    isolate: bool
    meaning: str = Field(min_length=1)


class NVRxRules(_Strict):
    faults: tuple[FaultRule, ...]
    unknown_fault: Verdict
    straggler: StragglerRule


class _Document(_Strict):
    nvsentinel: NVSentinelRules
    nvrx: NVRxRules


@dataclass(frozen=True)
class ExternalHealthCatalog:
    """external_health.yaml, validated and indexed (check names and fault types are case-insensitive)."""

    nvsentinel: NVSentinelRules
    nvrx: NVRxRules
    checks: dict[str, CheckRule]  # lower-cased check name -> rule
    actions: dict[str, ActionRule]
    components: dict[str, Category]  # lower-cased component class -> category
    faults: dict[str, FaultRule]  # lower-cased fault type or alias -> rule
    xid_checks: frozenset[str]
    sxid_checks: frozenset[str]
    fallen_checks: frozenset[str]
    fallen_codes: frozenset[str]
    xid_check_re: re.Pattern[str]
    xid_code_re: re.Pattern[str]


def _where(path: Path, raw: Any, loc: tuple[int | str, ...]) -> str:
    """ "nvsentinel.checks entry 3 (check 'GpuMemWatch')" for the entry a validation error is in."""
    text, node = "", raw
    for step in loc:
        if isinstance(step, int):
            node = node[step] if isinstance(node, list) and 0 <= step < len(node) else None
            text += f" entry {step}"
            key = next(
                (k for k in ("check", "fault", "action", "component") if isinstance(node, dict) and k in node), None
            )
            if key is not None and isinstance(node, dict):
                text += f" ({key} {node[key]!r})"
        else:
            node = node.get(step) if isinstance(node, dict) else None
            text += f".{step}" if text else step
    return f"{path}: {text}"


def _index(path: Path, section: str, rows: tuple[Any, ...], keys: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, row in enumerate(rows):
        for key in keys(row):
            low = key.lower()
            if low in out:
                raise CatalogError(f"{path}: {section} entry {i}: duplicate {key!r}")
            out[low] = row
    return out


def load_external_health_catalog(path: Path | None = None) -> ExternalHealthCatalog:
    """Read and validate external_health.yaml; any bad entry raises CatalogError (a ConfigError) naming it."""
    path = path or CATALOG_DIR / "external_health.yaml"
    try:
        raw = load_yaml(path.read_text(), str(path))
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc}") from None
    try:
        doc = _Document.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        # The last step is the field; the rest says which entry.
        field = str(loc[-1]) if loc else "<document>"
        where = _where(path, raw, loc[:-1]) if len(loc) > 1 else f"{path}:"
        raise CatalogError(f"{where}: field '{field}': {err['msg']}") from None
    nvs, nvrx = doc.nvsentinel, doc.nvrx
    checks = _index(path, "nvsentinel.checks", nvs.checks, lambda r: [r.check])
    special = {c.lower() for c in (*nvs.xid.checks, *nvs.sxid.checks, *nvs.xid.fallen_off_bus.checks)}
    clash = sorted(set(checks) & special)
    if clash:
        raise CatalogError(f"{path}: nvsentinel.checks: {', '.join(clash)} also listed under xid/sxid")
    actions = {a.action: a for a in nvs.actions}
    if len(actions) != len(nvs.actions):
        raise CatalogError(f"{path}: nvsentinel.actions: duplicate action")
    components = {
        k: r.category for k, r in _index(path, "nvsentinel.components", nvs.components, lambda r: [r.component]).items()
    }
    faults = _index(path, "nvrx.faults", nvrx.faults, lambda r: [r.fault, *r.aliases])
    return ExternalHealthCatalog(
        nvsentinel=nvs,
        nvrx=nvrx,
        checks=checks,
        actions=actions,
        components=components,
        faults=faults,
        xid_checks=frozenset(c.lower() for c in nvs.xid.checks),
        sxid_checks=frozenset(c.lower() for c in nvs.sxid.checks),
        fallen_checks=frozenset(c.lower() for c in nvs.xid.fallen_off_bus.checks),
        fallen_codes=frozenset(c.upper() for c in nvs.xid.fallen_off_bus.codes),
        xid_check_re=re.compile(nvs.xid.check_pattern, re.IGNORECASE),
        xid_code_re=re.compile(nvs.xid.code_pattern, re.IGNORECASE),
    )


# --------------------------------------------------------------------- detector
def _cap(severity: Severity, ceiling: Severity) -> Severity:
    return ceiling if SEVERITY_RANK[severity] > SEVERITY_RANK[ceiling] else severity


def _slug(text: str) -> str:
    return _SIG_CHARS.sub("_", text.lower()).strip("_")[:48] or "unnamed"


@dataclass(frozen=True)
class _Call:
    signature: str
    category: Category
    severity: Severity
    role: Role
    isolate: bool
    meaning: str


class ExternalHealthDetector:
    """HealthEvents of health.external -> anomalies (pure: one event in, its anomalies out)."""

    name = "external"

    def __init__(
        self,
        catalog: ExternalHealthCatalog | None = None,
        xids: XidCatalog | Mapping[int, XidEntry] | None = None,
    ) -> None:
        self._catalog = catalog if catalog is not None else load_external_health_catalog()
        # As XidDetector: the Xid table, and its buckets (guidance, the NVLink5 fatal/nonfatal overrides)
        # when a whole XidCatalog is given (or loaded).
        if xids is None:
            xids = load_xid_catalog()
        if isinstance(xids, XidCatalog):
            self._xids: Mapping[int, XidEntry] = xids.xids
            self._buckets: Mapping[str, XidBucket] = xids.buckets
        else:
            self._xids, self._buckets = xids, {}

    def detect(self, event: HealthEvent) -> list[Anomaly]:
        if event.is_healthy:
            return []  # a recovery report (NVSentinel's clearing event, an NVRx rank back in line)
        if event.origin == "nvrx":
            return self._nvrx(event)
        return self._nvsentinel(event)

    # -- NVSentinel --------------------------------------------------------------------------
    def _nvsentinel(self, event: HealthEvent) -> list[Anomaly]:
        cat = self._catalog
        check = event.check_name.lower()
        store_only = event.message.endswith(STORE_ONLY_MARK)
        xid = self._xid_code(event)
        call: _Call | None
        if xid is not None:
            call = self._xid_call(xid, event)
            if call is None:
                return []  # the Xid catalog says no action (IGNORE, follow-on Xids)
        elif check in cat.sxid_checks and (code := self._number(event.error_codes)) is not None:
            fatal = event.is_fatal
            call = _Call(
                signature=f"sxid_{code}",
                category="interconnect",
                severity="critical" if fatal else "warning",
                role="root",
                isolate=fatal,
                meaning=f"NVSwitch SXid {code}, {'fatal' if fatal else 'non-fatal'}",
            )
        else:
            call = self._check_call(event)
        if store_only:
            call = _Call(
                signature=call.signature,
                category=call.category,
                severity=_cap(call.severity, "warning" if event.is_fatal else "info"),
                role=call.role,
                isolate=False,
                meaning=call.meaning + "; NVSentinel marks it STORE_ONLY (observe, do not act)",
            )
        gpu = self._gpu_index(event.component_ids)
        where = f" GPU {gpu}" if gpu is not None else ""
        fatal_word = "fatal" if event.is_fatal else "non-fatal"
        action = event.recommended_action or "NONE"
        meaning = (
            f"NVSentinel {event.check_name} on {event.node}{where} ({fatal_word}, recommended {action}): {call.meaning}"
        )
        return [self._anomaly(event, call, meaning, gpu=gpu, node=event.node, job_id=None, rank=None)]

    def _xid_code(self, event: HealthEvent) -> int | None:
        cat = self._catalog
        check = event.check_name.lower()
        if check in cat.fallen_checks and any(c.upper() in cat.fallen_codes for c in event.error_codes):
            return cat.nvsentinel.xid.fallen_off_bus.xid
        by_name = cat.xid_check_re.match(event.check_name)
        if check not in cat.xid_checks and by_name is None:
            return None
        for code in event.error_codes:
            m = cat.xid_code_re.match(code.strip())
            if m:
                return int(m.group("code"))
        return int(by_name.group("code")) if by_name is not None else None

    def _xid_call(self, code: int, event: HealthEvent) -> _Call | None:
        entry = self._xids.get(code)
        if entry is None:
            # As XidDetector._unknown: worth a human's look, never an action.
            return _Call(f"xid_{code}", "gpu_hardware", "warning", "root", False, f"Xid {code}: not in the catalog")
        bucket = self._buckets.get(entry.bucket)
        severity, role, isolate, said = judge_xid(entry, bucket, event.message)
        if not entry.emit:
            return None
        guidance = f" ({bucket.guidance})" if bucket is not None else ""
        return _Call(
            signature=f"xid_{entry.xid}",
            category=entry.category,
            severity=severity,
            role=role,
            isolate=isolate,
            meaning=f"Xid {entry.xid} ({entry.name}){said}: {entry.meaning}; NVIDIA resolution {entry.bucket}{guidance}",
        )

    def _check_call(self, event: HealthEvent) -> _Call:
        cat = self._catalog
        rule = cat.checks.get(event.check_name.lower())
        signature = (rule.signature if rule and rule.signature else None) or f"nvsentinel_{_slug(event.check_name)}"
        if rule is None:
            category = cat.components.get((event.component or "").lower(), cat.nvsentinel.default_category)
            return _Call(signature, category, "warning", "root", False, "a check trainmedic's catalog does not know")
        if not event.is_fatal:
            return _Call(signature, rule.category, "warning", "root", False, rule.meaning)
        action = cat.actions.get((event.recommended_action or "NONE").upper())
        isolate = rule.isolate and (action.isolate if action is not None else True)
        return _Call(signature, rule.category, "critical", "root", isolate, rule.meaning)

    def _gpu_index(self, component_ids: list[str]) -> int | None:
        types = {t.lower() for t in self._catalog.nvsentinel.gpu_entity_types}
        for ident in component_ids:
            kind, _, value = ident.partition(":")
            if kind.lower() in types and _NUMBER.match(value.strip()):
                return int(value)
        return None

    @staticmethod
    def _number(codes: list[str]) -> int | None:
        for code in codes:
            if _NUMBER.match(code.strip()):
                return int(code)
        return None

    # -- NVRx --------------------------------------------------------------------------------
    def _nvrx(self, event: HealthEvent) -> list[Anomaly]:
        rules = self._catalog.nvrx
        if event.check_name == "nvrx_straggler":
            s = rules.straggler
            call = _Call(s.signature, s.category, s.severity, s.role, s.isolate, s.meaning)
            kinds = ", ".join(event.error_codes) or "a score below the threshold"
            meaning = f"NVRx straggler: {self._who(event)} ({kinds}): {s.meaning}"
        elif event.check_name == "nvrx_fault":
            fault = (event.error_codes[0] if event.error_codes else "").strip()
            rule = self._catalog.faults.get(fault.lower())
            if rule is not None:
                call = _Call(rule.signature, rule.category, rule.severity, rule.role, rule.isolate, rule.meaning)
            else:
                v = rules.unknown_fault
                call = _Call(
                    f"nvrx_{_slug(fault or 'fault')}",
                    v.category,
                    v.severity,
                    v.role,
                    False,
                    "a fault type trainmedic's catalog does not know",
                )
            if not event.is_fatal:
                call = _Call(
                    call.signature, call.category, _cap(call.severity, "warning"), call.role, False, call.meaning
                )
            fatal_word = "fatal" if event.is_fatal else "non-fatal"
            meaning = f"NVRx fault {fault or '?'} on {self._who(event)} ({fatal_word}): {call.meaning}"
        else:
            v = rules.unknown_fault
            call = _Call(f"nvrx_{_slug(event.check_name)}", v.category, _cap(v.severity, "warning"), v.role, False, "")
            meaning = f"NVRx {event.check_name} on {self._who(event)}: a report trainmedic's catalog does not know"
        return [self._anomaly(event, call, meaning, gpu=None, node=event.node, job_id=event.job_id, rank=event.rank)]

    @staticmethod
    def _who(event: HealthEvent) -> str:
        rank = f"rank {event.rank} " if event.rank is not None else ""
        job = f" (job {event.job_id})" if event.job_id else ""
        return f"{rank}on {event.node}{job}"

    # -- common ------------------------------------------------------------------------------
    def _anomaly(
        self,
        event: HealthEvent,
        call: _Call,
        meaning: str,
        *,
        gpu: int | None,
        node: str,
        job_id: str | None,
        rank: int | None,
    ) -> Anomaly:
        facts = {
            "origin": event.origin,
            "check": event.check_name,
            "codes": ",".join(event.error_codes),
            "recommended_action": event.recommended_action or "NONE",
            "fatal": "true" if event.is_fatal else "false",
        }
        if event.component:
            facts["component"] = event.component
        if event.message.endswith(STORE_ONLY_MARK):
            facts["processing_strategy"] = "STORE_ONLY"
        return Anomaly(
            event_id=stable_id("anm", event.event_id, call.signature),
            event_time=event.event_time,
            detector=self.name,
            signature=call.signature,
            category=call.category,
            severity=call.severity,
            role=call.role,
            isolate=call.isolate,
            source="external",
            provenance=external_provenance(event),
            job_id=job_id,
            node=node,
            rank=rank,
            gpu=gpu,
            line=(event.message or f"{event.origin} {event.check_name}")[:_LINE_MAX],
            meaning=meaning[:_MEANING_MAX],
            facts=facts,
        )
