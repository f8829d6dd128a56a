"""InfiniBand / RoCE port detector: a node's own RDMA ports, as `net.ports` carries them.

Pure logic with explicit state; the clock is the sample's `event_time`. The conditions are data
(streams/catalog/net_ports.yaml); the code knows two kinds:

- **state**: a port seen ACTIVE and LinkUp is no longer (state not ACTIVE / ACTIVE_DEFER, phys_state
  not LinkUp), or is missing from the node's sample;
- **counter**: a counters/<name> value rose by a threshold within a window.

Each condition is reported once per episode, when it begins (again only after it cleared). A
counter's first reading is a baseline, and a counter going down re-baselines. None is "unknown": a
state that could not be read neither starts nor ends a down episode.

Every anomaly is the node's own (the producer runs on the node and reads the node's kernel):
node = the sample's node, no job (streams/app.py re-keys it to the jobs on the node), source
"net", detector "net_ports", signature net_port_* from the catalog, category interconnect, and
facts device, port, link_layer ("InfiniBand", or "Ethernet" for RoCE), condition.

State, per node and collector: the last sample (a redelivered sample gives the same anomalies,
an older one nothing) and per (device, port) whether it was seen up, the open episodes and the
counter readings within their windows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from schemas.events import Anomaly, NetPort, NetPortSample
from schemas.ids import stable_id
from schemas.yamlsafe import YamlError, load_yaml
from streams.catalog import CATALOG_DIR, CatalogError
from streams.detectors.gpu_health import CatalogCondition

DEFAULT_PATH = CATALOG_DIR / "net_ports.yaml"
# Readings kept per counter and port within a window: one a second for a 10-minute window.
MAX_HISTORY = 600
# state_show's names for a port that passes traffic (ACTIVE_DEFER: active, a state change deferred).
ACTIVE_STATES = frozenset({"ACTIVE", "ACTIVE_DEFER"})
LINK_UP = "LinkUp"
ABSENT = "absent"


class _Condition(CatalogCondition):
    signature: str = Field(pattern=r"^net_port_[a-z0-9_]+$", max_length=64)


class StateCondition(_Condition):
    kind: Literal["state"]


class CounterCondition(_Condition):
    kind: Literal["counter"]
    fields: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$", max_length=64)], ...] = Field(min_length=1)
    threshold: int = Field(ge=1)
    window_s: float | None = Field(gt=0, le=86400)  # None: since the previous reading

    @model_validator(mode="after")
    def _distinct(self) -> CounterCondition:
        if len(set(self.fields)) != len(self.fields):
            raise ValueError("fields: a counter is listed twice")
        return self


Condition = Annotated[StateCondition | CounterCondition, Field(discriminator="kind")]
_CONDITION: TypeAdapter[StateCondition | CounterCondition] = TypeAdapter(Condition)


@dataclass(frozen=True)
class NetPortCatalog:
    conditions: tuple[StateCondition | CounterCondition, ...]


def load_net_port_catalog(path: Path | None = None) -> NetPortCatalog:
    """net_ports.yaml, validated; an error names the file, the entry (number and id) and the field."""
    path = path or DEFAULT_PATH
    try:
        data = load_yaml(path.read_text(), str(path))
    except YamlError as exc:
        raise CatalogError(str(exc)) from None
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or set(data) != {"conditions"}:
        raise CatalogError(f"{path}: expected exactly the key conditions")
    if not isinstance(data["conditions"], list) or not data["conditions"]:
        raise CatalogError(f"{path}: conditions: expected a list of entries")
    conditions: list[StateCondition | CounterCondition] = []
    for i, raw in enumerate(data["conditions"]):
        where = f"{path}: conditions entry {i}"
        if isinstance(raw, dict) and isinstance(raw.get("id"), str):
            where += f" (id {raw['id']!r})"
        try:
            cond = _CONDITION.validate_python(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(p) for p in err["loc"] if str(p) not in ("state", "counter")]
            raise CatalogError(f"{where}: {'field ' + repr('.'.join(loc)) + ': ' if loc else ''}{err['msg']}") from None
        for other in conditions:
            for attr in ("id", "signature"):
                if getattr(other, attr) == getattr(cond, attr):
                    raise CatalogError(f"{where}: duplicate {attr} {getattr(cond, attr)!r}")
        conditions.append(cond)
    if sum(isinstance(c, StateCondition) for c in conditions) > 1:
        raise CatalogError(f"{path}: more than one condition of kind state")
    return NetPortCatalog(conditions=tuple(conditions))


@dataclass
class _PortState:
    seen_up: bool = False
    link_layer: str | None = None
    episodes: dict[str, bool] = field(default_factory=dict)  # condition id -> active
    history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # counter -> readings


@dataclass
class _Stream:
    last_id: str = ""
    last_time: float = float("-inf")
    last_out: list[Anomaly] = field(default_factory=list)
    ports: dict[tuple[str, int], _PortState] = field(default_factory=dict)


@dataclass(frozen=True)
class _Finding:
    cond: _Condition
    line: str
    what: str
    facts: dict[str, str]


class NetPortDetector:
    """Ports that went down after being up, link downs and error-counter bursts, per node."""

    name = "net_ports"

    def __init__(self, catalog: NetPortCatalog | None = None) -> None:
        self._catalog = catalog if catalog is not None else load_net_port_catalog()
        self._streams: dict[tuple[str, str], _Stream] = {}

    def observe(self, sample: NetPortSample) -> list[Anomaly]:
        stream = self._streams.setdefault((sample.node, sample.collector), _Stream())
        if sample.event_id == stream.last_id:
            return list(stream.last_out)  # redelivered: the same anomalies, same ids
        if sample.event_time <= stream.last_time:
            return []  # older than what was seen: its counters would read as a reset, then a rise
        t = sample.event_time
        out: list[Anomaly] = []
        present: set[tuple[str, int]] = set()
        for port in sample.ports:
            key = (port.device, port.port)
            if key in present:
                continue
            present.add(key)
            state = stream.ports.setdefault(key, _PortState())
            state.link_layer = port.link_layer or state.link_layer
            for cond in self._catalog.conditions:
                if isinstance(cond, StateCondition):
                    found = self._state(cond, port, state)
                else:
                    found = self._counter(cond, port, state, t)
                if found is not None:
                    out.append(self._anomaly(sample, port.device, port.port, state, found))
        for key, state in stream.ports.items():
            if key in present:
                continue
            for cond in self._catalog.conditions:
                if isinstance(cond, StateCondition):
                    found = self._gone(cond, state)
                    if found is not None:
                        out.append(self._anomaly(sample, key[0], key[1], state, found))
            state.history.clear()  # a device that comes back starts its counters from a new baseline
        stream.last_id, stream.last_time, stream.last_out = sample.event_id, t, out
        return list(out)

    def forget(self, node: str) -> None:
        for key in [k for k in self._streams if k[0] == node]:
            del self._streams[key]

    # --- conditions ----------------------------------------------------------------------------

    @staticmethod
    def _state(cond: StateCondition, port: NetPort, state: _PortState) -> _Finding | None:
        if port.state is None and port.phys_state is None:
            return None  # unreadable: neither up nor down
        down = (port.state is not None and port.state not in ACTIVE_STATES) or (
            port.phys_state is not None and port.phys_state != LINK_UP
        )
        if not down:
            if port.state is not None and port.phys_state is not None:
                state.seen_up = True
            state.episodes[cond.id] = False
            return None
        if not state.seen_up or state.episodes.get(cond.id):
            return None
        state.episodes[cond.id] = True
        shown_state = f"{port.state_code}: {port.state}" if port.state is not None else "unreadable"
        shown_phys = f"{port.phys_state_code}: {port.phys_state}" if port.phys_state is not None else "unreadable"
        facts = {"state": port.state or "", "phys_state": port.phys_state or ""}
        facts |= {"error": port.error[:500]} if port.error else {}
        return _Finding(
            cond,
            line=f"state {shown_state}, phys_state {shown_phys} (was ACTIVE, LinkUp)",
            what=f"state {port.state or 'unreadable'}, phys_state {port.phys_state or 'unreadable'}",
            facts=facts,
        )

    @staticmethod
    def _gone(cond: StateCondition, state: _PortState) -> _Finding | None:
        if not state.seen_up or state.episodes.get(cond.id):
            return None
        state.episodes[cond.id] = True
        return _Finding(
            cond,
            line="port no longer in sysfs (was ACTIVE, LinkUp)",
            what="the port is no longer listed in sysfs (device gone or driver unloaded)",
            facts={"state": ABSENT, "phys_state": ABSENT},
        )

    @staticmethod
    def _counter(cond: CounterCondition, port: NetPort, state: _PortState, t: float) -> _Finding | None:
        spans: dict[str, tuple[int, int]] = {}
        read = False
        for name in cond.fields:
            value = port.counters.get(name)
            if value is None:
                continue
            read = True
            history = state.history.setdefault(name, deque(maxlen=MAX_HISTORY))
            if history and value < history[-1][1]:
                history.clear()  # cleared or reloaded: a new baseline, not a fault
            history.append((t, value))
            _trim(history, t, cond.window_s)
            if len(history) > 1:
                spans[name] = (history[0][1], value)
        if not read:
            return None
        rise = max((new - old for old, new in spans.values()), default=0)
        if rise < cond.threshold or state.episodes.get(cond.id):
            state.episodes[cond.id] = rise >= cond.threshold
            return None
        state.episodes[cond.id] = True
        window = f" within {cond.window_s:g} s" if cond.window_s is not None else ""
        facts = {"rise": str(rise), "threshold": str(cond.threshold)}
        facts |= {"window_s": f"{cond.window_s:g}"} if cond.window_s is not None else {}
        for counter, (old, new) in spans.items():
            facts |= {f"{counter}_from": str(old), f"{counter}_to": str(new)}
        changes = " ".join(f"{n} {old}->{new}" for n, (old, new) in spans.items())
        return _Finding(cond, line=changes + window, what=f"{changes}{window}", facts=facts)

    # --- output ----------------------------------------------------------------------------------

    def _anomaly(self, sample: NetPortSample, device: str, port: int, state: _PortState, f: _Finding) -> Anomaly:
        cond = f.cond
        layer = state.link_layer or "unknown link layer"
        kind = "RoCE" if state.link_layer == "Ethernet" else "InfiniBand" if state.link_layer == "InfiniBand" else ""
        where = f"{device} port {port} ({layer})"
        facts = {"condition": cond.id, "device": device, "port": str(port), "link_layer": state.link_layer or ""}
        facts |= {"rdma": kind} if kind else {}
        return Anomaly(
            # The sample's id, the condition and the port: a redelivered sample gives the same id.
            event_id=stable_id("anm", sample.event_id, cond.id, device, port),
            event_time=sample.event_time,
            detector=self.name,
            signature=cond.signature,
            category=cond.category,
            severity=cond.severity,
            role=cond.role,
            isolate=cond.isolate,
            source="net",
            node=sample.node,
            line=f"{sample.node} {where}: {f.line}"[:4096],
            meaning=f"{cond.title} on {sample.node} {where}: {f.what}: {cond.meaning}"[:4000],
            facts=facts | f.facts | {"collector": sample.collector},
        )


def _trim(history: deque[tuple[float, int]], t: float, window_s: float | None) -> None:
    """Keep the readings a rise is measured over: the previous one (no window) or those in the window."""
    if window_s is None:
        while len(history) > 2:
            history.popleft()
        return
    while len(history) > 1 and history[0][0] < t - window_s:
        history.popleft()
