"""Rolling upgrades: every consumer reads the current and the previous schema version.

The previous version's JSON Schemas and example payloads are kept as data in
schemas/json/v<N-1>/ (docs/schemas.md). Each example is valid against its own
version's schema, decodes into the current type on every topic that carries it,
and goes through the consumers' own decode paths that run without a broker: the
streams worker's recovery, the audit sink's rows, the executor's read-back of its
attempts, and the node-local placements.
"""

from __future__ import annotations

import json
import tomllib
from collections import Counter
from collections.abc import Iterable, Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, cast

import jsonschema
import orjson
import pytest
from confluent_kafka import Message

import producers.placements
import sinks.audit
import sinks.executor
import streams.recovery
from schemas import generate
from schemas.codec import DecodeError, decode, encode
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, ActionAttempt, Event, Incident, SchedEvent
from schemas.ids import DEFAULT_CLUSTER, current_cluster, set_cluster
from schemas.topics import ACTION_ATTEMPTS, ACTIONS, ALL_TOPICS, ANOMALIES, INCIDENTS, SCHED_EVENTS, Topic
from schemas.upgrade import ACCEPTED_VERSIONS, INTRODUCED, PREVIOUS_VERSION, UPGRADERS, UpgradeError, existed, upgrade
from sinks.backends.simulated import SimulatedScheduler
from sinks.guardrails import GuardrailFile, Guardrails

PREVIOUS = generate.PREVIOUS_DIR
# The types the previous version had (schemas.upgrade.INTRODUCED names the newer ones).
OLD_TYPES = tuple(t for t in EVENT_TYPES if existed(t.type_name, PREVIOUS_VERSION))
OLD_TOPICS = tuple(t for t in ALL_TOPICS if existed(t.event_type.type_name, PREVIOUS_VERSION))
BY_NAME = {t.type_name: t for t in OLD_TYPES}


def _example(type_name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((PREVIOUS / "examples" / f"{type_name}.json").read_text())
    return data


def _example_bytes(type_name: str) -> bytes:
    return (PREVIOUS / "examples" / f"{type_name}.json").read_bytes()


def _as_current(type_name: str, old: dict[str, Any]) -> dict[str, Any]:
    """What the previous version's payload says, in the current version's words."""
    fields = BY_NAME[type_name].model_fields
    new = {k: v for k, v in old.items() if k in fields}
    if type_name == "incident":
        new["isolate"] = old["recommended_action"] == "drain_and_requeue"
    return {**new, "schema_version": SCHEMA_VERSION, "cluster": DEFAULT_CLUSTER}


def _written(actual: Any, expected: Any) -> Any:
    """`actual` limited to what `expected` writes: fields a payload leaves out take defaults."""
    if isinstance(actual, dict) and isinstance(expected, dict):
        return {k: _written(actual[k], v) for k, v in expected.items() if k in actual}
    if isinstance(actual, list) and isinstance(expected, list) and len(actual) == len(expected):
        return [_written(a, e) for a, e in zip(actual, expected, strict=True)]
    return actual


def _assert_carries(event: Event, old: dict[str, Any]) -> None:
    expected = _as_current(event.type_name, old)
    assert _written(event.model_dump(mode="json"), expected) == expected


@pytest.fixture
def other_cluster() -> Iterator[str]:
    """This process serves another cluster than the default one."""
    before = current_cluster()
    set_cluster("east")
    try:
        yield "east"
    finally:
        set_cluster(before)


# --- the data -------------------------------------------------------------------------


def test_the_previous_version_is_kept_for_every_type() -> None:
    assert (SCHEMA_VERSION, PREVIOUS_VERSION) == (2, 1)
    assert ACCEPTED_VERSIONS == (PREVIOUS_VERSION, SCHEMA_VERSION)
    names = {t.type_name for t in OLD_TYPES}
    assert {t.type_name for t in EVENT_TYPES} - names == set(INTRODUCED)
    assert {p.name.removesuffix(".schema.json") for p in PREVIOUS.glob("*.schema.json")} == names
    assert {p.stem for p in (PREVIOUS / "examples").glob("*.json")} == names
    # Generating the current version writes none of the previous version's files.
    assert all("/" not in name for name in generate.render())


@pytest.mark.parametrize("type_name", sorted(BY_NAME))
def test_each_previous_example_is_valid_in_its_own_version(type_name: str) -> None:
    schema = json.loads((PREVIOUS / f"{type_name}.schema.json").read_text())
    assert schema["properties"]["schema_version"]["const"] == PREVIOUS_VERSION
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    validator.check_schema(schema)
    example = _example(type_name)
    validator.validate(example)
    # A current-version payload is not a previous-version one: the schemas tell them apart.
    current = orjson.loads(encode(decode(BY_NAME[type_name], _example_bytes(type_name))))
    assert not validator.is_valid(current)


# --- the codec ------------------------------------------------------------------------


@pytest.mark.parametrize("topic", OLD_TOPICS, ids=lambda t: t.name)
def test_previous_examples_decode_on_every_topic_into_the_current_type(topic: Topic) -> None:
    name = topic.event_type.type_name
    event = decode(topic.event_type, _example_bytes(name))
    assert type(event) is topic.event_type
    assert event.schema_version == SCHEMA_VERSION
    _assert_carries(event, _example(name))


@pytest.mark.parametrize("type_name", sorted(BY_NAME))
def test_upgraded_events_round_trip_at_the_current_version(type_name: str) -> None:
    event = decode(BY_NAME[type_name], _example_bytes(type_name))
    written = encode(event)
    assert orjson.loads(written)["schema_version"] == SCHEMA_VERSION
    assert decode(BY_NAME[type_name], written) == event


def test_every_type_has_an_upgrade_from_the_previous_version() -> None:
    for t in OLD_TYPES:
        step = UPGRADERS[(t.type_name, PREVIOUS_VERSION)]
        assert step(_example(t.type_name))["schema_version"] == SCHEMA_VERSION, t.type_name
    assert all(version == PREVIOUS_VERSION for _, version in UPGRADERS)
    assert upgrade("incident", _example("incident")) == _as_current("incident", _example("incident"))


def test_a_previous_version_event_is_the_default_clusters_whoever_reads_it(other_cluster: str) -> None:
    old = decode(SchedEvent, _example_bytes("sched_event"))
    assert old.cluster == DEFAULT_CLUSTER
    assert SchedEvent(event_id="s", event_time=1.0, kind="node", state="IDLE").cluster == other_cluster


def test_the_incident_upgrade_turns_the_recommended_action_into_the_isolate_fact() -> None:
    old = _example("incident")
    assert old["recommended_action"] == "drain_and_requeue"
    new = upgrade("incident", old)
    assert new == {
        **{k: v for k, v in old.items() if k != "recommended_action"},
        "schema_version": 2,
        "cluster": "default",
        "isolate": True,  # a v1 drain recommendation: the fault lives on the culprit's node
    }
    event = decode(Incident, _example_bytes("incident"))
    assert event.isolate and "recommended_action" not in event.model_dump()
    assert upgrade("incident", old | {"recommended_action": "requeue"})["isolate"] is False
    for broken, problem in [({}, "Field required"), ({"recommended_action": "reboot"}, "Input should be one of")]:
        data = {k: v for k, v in old.items() if k != "recommended_action"} | broken
        with pytest.raises(UpgradeError) as err:
            upgrade("incident", data)
        assert err.value.field == "recommended_action" and problem in err.value.problem


@pytest.mark.parametrize(
    ("type_name", "mutate", "field", "problem"),
    [
        # Version 1 required an action on an incident, one of schemas.vocab.ACTIONS.
        ("incident", lambda d: d.pop("recommended_action"), "recommended_action", "Field required"),
        ("incident", lambda d: d.update(recommended_action="reboot"), "recommended_action", "Input should be"),
        # Version 1 had no cluster: a payload that names one is not a version 1 payload.
        ("anomaly", lambda d: d.update(cluster="east"), "cluster", "Extra inputs"),
        # Fields the upgrade leaves alone are still checked after it.
        ("anomaly", lambda d: d.update(severity="dire"), "severity", "Input should be"),
        ("log_batch", lambda d: d["lines"][0].update(rank=-1), "lines.0.rank", "greater than or equal"),
    ],
)
def test_an_invalid_previous_version_payload_names_the_field(  # type: ignore[no-untyped-def]
    type_name: str, mutate, field: str, problem: str
) -> None:
    data = _example(type_name)
    mutate(data)
    with pytest.raises(DecodeError) as err:
        decode(BY_NAME[type_name], orjson.dumps(data))
    assert (err.value.field, err.value.event_type) == (field, type_name)
    assert problem in err.value.problem
    assert field in str(err.value)


@pytest.mark.parametrize("version", [0, 3, -1, "1", "2", 1.0, True, None])
def test_other_versions_are_refused_naming_the_accepted_ones(version: object) -> None:
    for t in OLD_TYPES:
        data = {**_example(t.type_name), "schema_version": version}
        with pytest.raises(DecodeError) as err:
            decode(t, orjson.dumps(data))
        assert err.value.field == "schema_version"
        assert f"unsupported version {version!r}" in err.value.problem
        assert "accepted: 1 and 2" in err.value.problem


def test_a_payload_without_a_version_is_refused() -> None:
    data = _example("kernel_event")
    del data["schema_version"]
    with pytest.raises(DecodeError, match="unsupported version None"):
        decode(BY_NAME["kernel_event"], orjson.dumps(data))


# --- the consumers' own decode paths --------------------------------------------------


class _Msg:
    """The part of a confluent_kafka Message the consumers read."""

    def __init__(self, topic: str, value: bytes, offset: int = 0) -> None:
        self._topic, self._value, self._offset = topic, value, offset

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, 0)


def _records(topic: Topic) -> list[tuple[float, bytes]]:
    return [(1.0, _example_bytes(topic.event_type.type_name))]


def test_the_streams_workers_recovery_reads_the_previous_version(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def read_records(bootstrap: str, topic: str, since: float) -> list[tuple[float, bytes]]:
        asked.append(topic)
        return _records({t.name: t for t in ALL_TOPICS}[topic])

    monkeypatch.setattr(streams.recovery, "read_records", read_records)
    history = streams.recovery.read_history("unused:9092", 1e9, 60.0, 3600.0)
    actions = streams.recovery.read_actions("unused:9092", 1e9 - 3600.0)
    assert sorted(asked) == sorted(t.name for t in (INCIDENTS, ANOMALIES, ACTIONS, SCHED_EVENTS))
    assert history.undecodable == 0
    recovered: list[tuple[list[Event], str]] = [
        (list(history.incidents), "incident"),
        ([a for _, a in history.anomalies], "anomaly"),
        ([a for a in actions], "action"),
        (list(history.sched), "sched_event"),
    ]
    for events, name in recovered:
        (event,) = events
        _assert_carries(event, _example(name))


class _Store:
    def query(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return []


class _NoConsumer:
    def __init__(self, bootstrap: str, group: str, client_id: str, **overrides: Any) -> None:
        self.group = group


def test_the_audit_sink_makes_rows_of_the_previous_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sinks.audit, "group_consumer", _NoConsumer)
    sink = sinks.audit.AuditSink("unused:9092", cast(sinks.audit.AuditStore, _Store()))
    old = {name: v for name, v in sinks.audit.TABLES.items() if existed(v[0].event_type.type_name, PREVIOUS_VERSION)}
    msgs = [_Msg(name, _example_bytes(t.event_type.type_name), i) for i, (name, (t, *_)) in enumerate(old.items())]
    rows = sink._rows(cast(list[Message], msgs))
    assert sink.undecodable == 0
    assert {table: len(r) for table, r in rows.items()} == Counter(table for _, table, _, _ in old.values())
    for _, table, _, columns in sinks.audit.TABLES.values():
        assert all(len(row) == len(columns) for row in rows[table])


class _RecordingGuardrails(Guardrails):
    def __init__(self) -> None:
        super().__init__(GuardrailFile(None), SimulatedScheduler(["gpu01", "gpu02"]))
        self.restored: list[ActionAttempt] = []

    def restore(self, attempts: Iterable[ActionAttempt]) -> int:
        got = list(attempts)
        self.restored.extend(got)
        return super().restore(got)


def test_the_executor_reads_back_previous_version_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    def read_records(bootstrap: str, topic: str, since: float) -> list[tuple[float, bytes]]:
        assert topic == ACTION_ATTEMPTS.name
        return _records(ACTION_ATTEMPTS)

    monkeypatch.setattr(sinks.executor, "read_records", read_records)
    # Only what _restore reads is set: constructing a replica joins its lease group on a broker.
    service = sinks.executor.ExecutorService.__new__(sinks.executor.ExecutorService)
    service._bootstrap = "unused:9092"
    service.guardrails = guardrails = _RecordingGuardrails()
    assert service._restore()
    (attempt,) = guardrails.restored
    _assert_carries(attempt, _example("action_attempt"))


class _SchedFollower:
    """sched.events holding the previous version's example, then nothing."""

    def __init__(self, bootstrap: str, topic: str, client_id: str, timeout_s: float = 10.0) -> None:
        assert topic == SCHED_EVENTS.name
        self.pending = [_example_bytes("sched_event")]
        self.caught_up = False

    def poll(self, max_records: int = 50_000, timeout_s: float = 0.05) -> list[bytes]:
        out, self.pending, self.caught_up = self.pending, [], True
        return out

    def close(self) -> None:
        pass


def test_node_placements_read_previous_version_job_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producers.placements, "Follower", _SchedFollower)
    placements = producers.placements.BusPlacements("unused:9092", "gpu01", resync=None)
    assert placements() == {"4242": 0}
    assert placements.events_read == 1


def test_the_previous_versions_files_ship_as_package_data() -> None:
    package = Path(generate.__file__).parent
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["schemas"]
    shipped = [p for p in PREVIOUS.rglob("*.json") if any(fnmatch(str(p.relative_to(package)), g) for g in patterns)]
    assert len(shipped) == 2 * len(OLD_TYPES)


def test_a_type_new_in_this_version_refuses_a_previous_version_payload_saying_why() -> None:
    from schemas.events import JobAttempt

    payload = {
        "schema_version": PREVIOUS_VERSION,
        "event_id": "att-1",
        "event_time": 1.0,
        "lineage_id": "lin-1",
        "job_id": "7",
        "first_seen": 1.0,
        "attempt": 1,
        "restart_count": 0,
        "started_at": 1.0,
    }
    with pytest.raises(DecodeError, match="job_attempt exists since version 2"):
        decode(JobAttempt, orjson.dumps(payload))
    assert decode(JobAttempt, orjson.dumps({**payload, "schema_version": SCHEMA_VERSION})).attempt == 1
