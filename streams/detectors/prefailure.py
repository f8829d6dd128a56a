"""Pre-failure verdicts per GPU and node (issue 44, deliverable 1): the first brick only.

Pure logic with explicit state, as the other detectors: the caller feeds `gpu.samples` and the
clock is each sample's `event_time`. The rules are data (streams/catalog/prefailure.yaml, read
through `load_catalog_model`); the code knows two kinds:

- **state**: a state NVIDIA documents, read from one boolean GpuMetrics field (row remap pending,
  retired pages pending: the GPU needs a reset at its next idle moment);
- **trend**: over a window, a counter's rise (`rate`), its rise against the window before
  (`acceleration`), or the share of samples with a slowdown reason (`share`).

Each condition gives one verdict when it begins and is re-armed only when it clears (a state flag
reads False, a trend falls below its threshold). None is "unknown": it neither starts nor clears
anything. A counter's first reading is a baseline and a counter going down (driver reload, GPU
reset) re-baselines, as in streams/detectors/gpu_health.py. Windows are bounded twice: by time
and by `MAX_SAMPLES` readings per GPU, rule and counter.

A verdict's id is derived from the sample that raised it, the rule and the GPU, so a redelivered
sample gives the same verdict (and id); an older sample than the last one seen gives nothing.
`node_verdict` summarises a node's open verdicts.

NOT wired yet (next sessions, docs/prediction.md): no Faust agent feeds this detector and no
topic carries its verdicts; the checkpoint-aligned migration that acts on them (deliverable 2,
with its policy, executor and Slurm tests), readiness scoring of predictions (deliverable 3) and
the benchmark scenario (deliverable 4) are still to come.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.events import GpuMetrics, GpuSample
from schemas.ids import stable_id
from streams.catalog import CATALOG_DIR, CatalogError, load_catalog_model
from streams.detectors.gpu_health import CounterField, FlagField, ReasonName
from streams.detectors.gpu_streams import GpuSampleStreams

DEFAULT_PATH = CATALOG_DIR / "prefailure.yaml"
# Readings kept per window: a window is kept at a resolution of window_s / SLOTS (a newer reading
# within one slot of the previous kept one replaces the newest instead of adding one), so a GPU
# sampled every second holds ~SLOTS readings per counter and window, not one per sample: a fleet of
# 40,000 GPUs times a one-hour window would otherwise hold hundreds of millions of readings. The
# price: a window's start is known to within 1/SLOTS of the window. MAX_SAMPLES is the hard bound
# per GPU, rule and counter (two windows for acceleration, plus the newest and a baseline).
SLOTS = 60
MAX_SAMPLES = 2 * SLOTS + 4

Failure = Literal["reset_required", "uncorrectable_ecc", "nvlink_down", "fallen_off_bus", "slowdown"]


# --- catalog -----------------------------------------------------------------------------


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https://\S+$", max_length=300)
    version: str = Field(min_length=4, max_length=200)  # the document's version or the date read
    says: str = Field(min_length=10, max_length=1000)  # what it says that the rule relies on


class Predicts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    failure: Failure
    xids: tuple[int, ...] = ()  # how the driver logs that failure, where it has an Xid


class Confidence(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    value: float = Field(ge=0.0, le=1.0)
    # cited: a published precision; documented: NVIDIA documents the state's consequence;
    # placeholder: ours, until readiness scoring measures it.
    basis: Literal["cited", "documented", "placeholder"]
    note: str = Field(min_length=10, max_length=1000)


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9_]+$", max_length=64)
    title: str = Field(min_length=1, max_length=120)
    predicts: Predicts
    lead_time_s: float | None = Field(ge=0)
    lead_time_note: str | None = Field(default=None, min_length=10, max_length=1000)
    confidence: Confidence
    meaning: str = Field(min_length=1, max_length=2000)
    sources: tuple[Source, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _lead_time_explained(self) -> _Rule:
        # A missing lead time must say why, so that nobody fills the gap with a guess later.
        if self.lead_time_s is None and self.lead_time_note is None:
            raise ValueError("lead_time_s is null: lead_time_note must say why no source gives one")
        return self


class StateRule(_Rule):
    kind: Literal["state"]
    field: FlagField


class TrendRule(_Rule):
    kind: Literal["trend"]
    measure: Literal["rate", "acceleration", "share"]
    fields: tuple[CounterField, ...] = ()  # rate, acceleration
    reasons: tuple[ReasonName, ...] = ()  # share
    window_s: float = Field(gt=0, le=86400)
    threshold: float = Field(gt=0)  # rate/acceleration: rise within the window; share: fraction
    factor: float | None = Field(default=None, gt=1)  # acceleration: latest rise >= factor x previous
    threshold_basis: Literal["cited", "placeholder"]
    threshold_note: str = Field(min_length=10, max_length=1000)

    @model_validator(mode="after")
    def _shape(self) -> TrendRule:
        counts = self.measure in ("rate", "acceleration")
        if counts and (not self.fields or self.reasons):
            raise ValueError(f"measure {self.measure} reads counters: give fields, not reasons")
        if not counts and (not self.reasons or self.fields):
            raise ValueError("measure share reads throttle reasons: give reasons, not fields")
        if (self.measure == "acceleration") != (self.factor is not None):
            raise ValueError("factor is given exactly for measure acceleration")
        if self.measure == "share" and self.threshold > 1:
            raise ValueError("a share threshold is a fraction of samples, at most 1")
        if len(set(self.fields)) != len(self.fields):
            raise ValueError("fields: a counter is listed twice")
        return self


Rule = Annotated[StateRule | TrendRule, Field(discriminator="kind")]


class PreFailureCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[Rule, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> PreFailureCatalog:
        ids = [r.id for r in self.rules]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate rule id {', '.join(dupes)}")
        return self


def load_prefailure_catalog(path: Path | None = None) -> PreFailureCatalog:
    """prefailure.yaml, validated; a CatalogError names the file and the first bad field."""
    catalog = load_catalog_model(path or DEFAULT_PATH, PreFailureCatalog)
    known = set(GpuMetrics.model_fields)
    for rule in catalog.rules:
        # The Literal types already hold this; the check keeps it true if they ever widen.
        named: list[str] = [rule.field] if isinstance(rule, StateRule) else list(rule.fields)
        if isinstance(rule, TrendRule) and rule.measure == "share":
            named.append("throttle_reasons")
        missing = [n for n in named if n not in known]
        if missing:
            raise CatalogError(f"{path or DEFAULT_PATH}: rule {rule.id!r}: GpuMetrics has no field {missing[0]!r}")
    return catalog


# --- verdicts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreFailureVerdict:
    """One GPU's condition that foretells a failure, as the rule that found it describes it."""

    event_id: str
    node: str
    gpu: int
    uuid: str | None
    rule_id: str
    kind: Literal["state", "trend"]
    predicts: Failure
    xids: tuple[int, ...]
    evidence: dict[str, str]  # the readings that crossed the rule, as text
    lead_time_s: float | None
    lead_time_note: str | None
    confidence: float
    confidence_basis: str
    first_seen: float  # event_time of the sample that raised it
    sample_id: str
    collector: str
    sources: tuple[str, ...]  # the rule's source URLs


@dataclass(frozen=True)
class NodeVerdict:
    """A node's open GPU verdicts in one: what the migration of deliverable 2 will read."""

    node: str
    gpus: tuple[int, ...]
    failures: tuple[Failure, ...]
    confidence: float  # the highest of its verdicts'
    lead_time_s: float | None  # the shortest known lead time; None when no verdict has one
    first_seen: float
    verdicts: tuple[PreFailureVerdict, ...]


def node_verdict(verdicts: list[PreFailureVerdict] | tuple[PreFailureVerdict, ...]) -> NodeVerdict | None:
    """One node's verdicts summarised; None for none. Verdicts of several nodes are refused."""
    if not verdicts:
        return None
    nodes = {v.node for v in verdicts}
    if len(nodes) > 1:
        raise ValueError(f"verdicts of several nodes: {', '.join(sorted(nodes))}")
    ordered = tuple(sorted(verdicts, key=lambda v: (v.first_seen, v.gpu, v.rule_id)))
    leads = [v.lead_time_s for v in ordered if v.lead_time_s is not None]
    return NodeVerdict(
        node=ordered[0].node,
        gpus=tuple(sorted({v.gpu for v in ordered})),
        failures=tuple(dict.fromkeys(v.predicts for v in ordered)),
        confidence=max(v.confidence for v in ordered),
        lead_time_s=min(leads) if leads else None,
        first_seen=ordered[0].first_seen,
        verdicts=ordered,
    )


# --- state --------------------------------------------------------------------------------------


@dataclass
class _GpuState:
    uuid: str | None
    active: dict[str, PreFailureVerdict] = field(default_factory=dict)  # rule id -> open verdict
    counters: dict[tuple[str, str], deque[tuple[float, int]]] = field(default_factory=dict)
    # when each counter's current baseline began (first reading, or the reading after a reset)
    counter_since: dict[tuple[str, str], float] = field(default_factory=dict)
    throttled: dict[str, deque[tuple[float, int, int]]] = field(default_factory=dict)
    # share rules: when the current unbroken run of readable samples began
    share_since: dict[str, float] = field(default_factory=dict)
    last_time: float | None = None


# --- detector -------------------------------------------------------------------------------------


class PreFailureDetector:
    """Feeds on GpuSample; answers the verdicts each sample starts."""

    name = "prefailure"

    def __init__(self, catalog: PreFailureCatalog | None = None) -> None:
        self._catalog = catalog if catalog is not None else load_prefailure_catalog()
        self._streams: GpuSampleStreams[_GpuState, PreFailureVerdict] = GpuSampleStreams(
            lambda uuid: _GpuState(uuid=uuid)
        )

    def observe(self, sample: GpuSample) -> list[PreFailureVerdict]:
        # A GPU gone from the node's sample takes its windows with it (gpu_streams).
        return self._streams.observe(sample, self._observe_gpu)

    def open_verdicts(self, node: str) -> list[PreFailureVerdict]:
        """The node's verdicts whose condition still holds, over every producer of the node."""
        return [v for g in self._streams.states(node) for v in g.active.values()]

    def node_verdict(self, node: str) -> NodeVerdict | None:
        return node_verdict(self.open_verdicts(node))

    def retained(self) -> int:
        """Readings held in every window: what bounds this detector's memory per GPU."""
        gpus = list(self._streams.states())
        return sum(len(d) for g in gpus for d in g.counters.values()) + sum(
            len(d) for g in gpus for d in g.throttled.values()
        )

    def forget(self, node: str) -> None:
        self._streams.forget(node)

    # --- one GPU --------------------------------------------------------------------------

    def _observe_gpu(self, sample: GpuSample, state: _GpuState, gpu: GpuMetrics) -> list[PreFailureVerdict]:
        # A new GPU in the slot starts with new baselines and no open verdicts (gpu_streams).
        t = sample.event_time
        out: list[PreFailureVerdict] = []
        for rule in self._catalog.rules:
            if isinstance(rule, StateRule):
                held, evidence = self._state(rule, gpu)
            elif rule.measure == "share":
                held, evidence = self._share(rule, gpu, state, t)
            else:
                held, evidence = self._counters(rule, gpu, state, t)
            if held is None:
                continue  # unknown: the condition neither starts nor clears
            if not held:
                state.active.pop(rule.id, None)  # cleared: re-armed
            elif rule.id not in state.active:
                verdict = self._verdict(sample, gpu, state, rule, evidence)
                state.active[rule.id] = verdict
                out.append(verdict)
        state.last_time = t
        return out

    @staticmethod
    def _state(rule: StateRule, gpu: GpuMetrics) -> tuple[bool | None, dict[str, str]]:
        value = getattr(gpu, rule.field)
        if value is None:
            return None, {}
        return bool(value), {rule.field: str(bool(value)).lower()}

    def _counters(
        self, rule: TrendRule, gpu: GpuMetrics, state: _GpuState, t: float
    ) -> tuple[bool | None, dict[str, str]]:
        # acceleration compares two windows: keep two windows' readings.
        span = rule.window_s * (2 if rule.measure == "acceleration" else 1)
        best: tuple[float, dict[str, str]] | None = None
        read = False
        for name in rule.fields:
            value = getattr(gpu, name)
            if value is None:
                continue
            read = True
            key = (rule.id, name)
            history = state.counters.setdefault(key, deque(maxlen=MAX_SAMPLES))
            if history and value < history[-1][1]:
                history.clear()  # reset (driver reload, GPU reset): a new baseline, not a fault
            if not history:
                state.counter_since[key] = t
            _keep(history, (t, value), rule.window_s / SLOTS)
            while history[0][0] < t - span:
                history.popleft()
            found = self._measure(rule, name, history, t, state.counter_since[key])
            if found is not None and (best is None or found[0] > best[0]):
                best = found
        if not read:
            return None, {}
        if best is None:
            return False, {}
        return True, best[1]

    @staticmethod
    def _measure(
        rule: TrendRule, name: str, history: deque[tuple[float, int]], t: float, since: float
    ) -> tuple[float, dict[str, str]] | None:
        """The counter's rise if the rule holds on it (with its evidence), else None. A rise is
        measured from the oldest reading within the window, as gpu_health measures it: a rise spread
        over more than the window never counts whole."""
        start = t - rule.window_s
        base = next(r for r in history if r[0] >= start)
        rise = history[-1][1] - base[1]
        if rise < rule.threshold:
            return None
        evidence = {
            "counter": name,
            "from": str(base[1]),
            "to": str(history[-1][1]),
            "rise": str(rise),
            "over_s": f"{t - base[0]:g}",
            "window_s": f"{rule.window_s:g}",
            "threshold": f"{rule.threshold:g}",
        }
        if rule.measure == "rate":
            return float(rise), evidence
        # acceleration: the window before must have been watched whole to be compared with.
        if since > start - rule.window_s:
            return None
        before_base = history[0]  # the oldest reading kept: within the window before
        before = base[1] - before_base[1]
        assert rule.factor is not None  # the catalog model's rule for acceleration
        if rise < rule.factor * before:
            return None
        return float(rise), evidence | {"previous_rise": str(before), "factor": f"{rule.factor:g}"}

    def _share(
        self, rule: TrendRule, gpu: GpuMetrics, state: _GpuState, t: float
    ) -> tuple[bool | None, dict[str, str]]:
        reasons = gpu.throttle_reasons
        if reasons is None:
            return None, {}
        # Slots of (start, slowed samples, samples): the share counts samples, not slots.
        history = state.throttled.setdefault(rule.id, deque(maxlen=MAX_SAMPLES))
        if history and t - history[-1][0] > rule.window_s:
            history.clear()  # a gap longer than the window: what came before says nothing about now
        if not history:
            state.share_since[rule.id] = t
        slowed = any(r in rule.reasons for r in reasons)
        if history and t - history[-1][0] < rule.window_s / SLOTS:
            start, n_slowed, n = history[-1]
            history[-1] = (start, n_slowed + slowed, n + 1)
        else:
            history.append((t, int(slowed), 1))
        while history[0][0] <= t - rule.window_s:
            history.popleft()
        if t - state.share_since[rule.id] < rule.window_s:
            return False, {}  # a full window not yet observed: too early to judge a share
        total = sum(n for _, _, n in history)
        share = sum(k for _, k, _ in history) / total
        if share < rule.threshold:
            return False, {}
        return True, {
            "share": f"{share:.3f}",
            "samples": str(total),
            "window_s": f"{rule.window_s:g}",
            "threshold": f"{rule.threshold:g}",
            "throttle_reasons": ",".join(reasons),
        }

    # --- output ------------------------------------------------------------------------------

    def _verdict(
        self,
        sample: GpuSample,
        gpu: GpuMetrics,
        state: _GpuState,
        rule: StateRule | TrendRule,
        evidence: dict[str, str],
    ) -> PreFailureVerdict:
        return PreFailureVerdict(
            # The sample's id, the rule and the GPU: a redelivered sample gives the same id.
            event_id=stable_id("pfv", sample.event_id, rule.id, gpu.index),
            node=sample.node,
            gpu=gpu.index,
            uuid=gpu.uuid or state.uuid,
            rule_id=rule.id,
            kind=rule.kind,
            predicts=rule.predicts.failure,
            xids=rule.predicts.xids,
            evidence=evidence,
            lead_time_s=rule.lead_time_s,
            lead_time_note=rule.lead_time_note,
            confidence=rule.confidence.value,
            confidence_basis=rule.confidence.basis,
            first_seen=sample.event_time,
            sample_id=sample.event_id,
            collector=sample.collector,
            sources=tuple(s.url for s in rule.sources),
        )


def _keep(history: deque[tuple[float, int]], reading: tuple[float, int], resolution: float) -> None:
    """Add a reading at the window's resolution: one within `resolution` of the last kept one
    replaces the newest (the first reading, the baseline, always stays)."""
    if len(history) >= 2 and reading[0] - history[-2][0] < resolution:
        history[-1] = reading
    else:
        history.append(reading)
