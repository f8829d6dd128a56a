"""The published JSON Schemas (schemas/json/*.schema.json) and the topic table of docs/schemas.md.

The schemas are forward compatible within a version (docs/schemas.md): a reader holding an
earlier copy accepts a later release's records, which carry fields that copy does not name,
while what a schema names stays checked. Every check validates the committed files, with
jsonschema's draft 2020-12 validator, against records that trainmedic's own codec writes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import orjson
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from schemas import generate
from schemas.codec import encode
from schemas.errors import ConfigError
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, Event, Incident
from schemas.topics import ALL_TOPICS
from tests.unit.test_properties import PROPS, model_strategy, props
from tests.unit.test_schemas import _batch

TYPE_NAMES = [t.type_name for t in EVENT_TYPES]


def _committed(type_name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((generate.OUT_DIR / f"{type_name}.schema.json").read_text())
    return data


def _validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def _errors(schema: dict[str, Any], record: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(schema).iter_errors(record)]


def _wire(event: Event) -> dict[str, Any]:
    """The record as it travels: what the codec writes, read back as JSON."""
    data: dict[str, Any] = orjson.loads(encode(event))
    return data


def _incident() -> Incident:
    return Incident(
        event_id="inc-1",
        event_time=2.0,
        incident_id="inc-1",
        job_id="1001",
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        confidence=0.95,
        explanation="gpu02 reported xid_79",
        evidence=[],
        anomaly_ids=["anm-1"],
        first_signal_time=1.0,
    )


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_each_schema_declares_its_dialect_and_a_versioned_id(type_name: str) -> None:
    schema = _committed(type_name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://trainmedic.dev/schemas/v{SCHEMA_VERSION}/{type_name}.schema.json"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_no_record_object_is_closed() -> None:
    # additionalProperties false anywhere (a nested evidence or sample too) breaks older readers.
    def closed(node: Any, where: str) -> list[str]:
        if isinstance(node, dict):
            own = [where] if node.get("additionalProperties") is False else []
            return own + [p for k, v in node.items() for p in closed(v, f"{where}/{k}")]
        if isinstance(node, list):
            return [p for i, v in enumerate(node) for p in closed(v, f"{where}/{i}")]
        return []

    assert [p for name in TYPE_NAMES for p in closed(_committed(name), name)] == []


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.type_name)
@props(15)
@given(data=st.data())
def test_every_record_the_codec_writes_is_valid(event_type: type[Event], data: st.DataObject) -> None:
    assert _errors(_committed(event_type.type_name), _wire(data.draw(model_strategy(event_type)))) == []


# The properties below fail on the schema whatever the record: shrinking the record says nothing
# more and would take minutes over every type.
BY_SCHEMA = settings(PROPS, max_examples=3, phases=[Phase.generate])


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.type_name)
@BY_SCHEMA
@given(data=st.data())
def test_a_record_with_unknown_fields_is_valid(event_type: type[Event], data: st.DataObject) -> None:
    schema = _committed(event_type.type_name)
    record = _wire(data.draw(model_strategy(event_type)))
    # A later release's record: a field this copy does not name, on the event and on each record
    # object in it (a field whose schema refers to a model: not a plain mapping such as counters).
    for name, value in list(record.items()):
        if "$ref" in json.dumps(schema["properties"][name]):
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict):
                    item["also_added"] = 2
    record["added_in_a_later_release"] = {"any": ["value", 1]}
    assert _errors(schema, record) == []


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.type_name)
@BY_SCHEMA
@given(data=st.data())
def test_an_earlier_copy_without_an_optional_field_accepts_records_carrying_it(
    event_type: type[Event], data: st.DataObject
) -> None:
    # The case: a reader's copy predates an optional field (incident.domain, say).
    schema = _committed(event_type.type_name)
    optional = sorted(set(schema["properties"]) - set(schema.get("required", [])) - {"schema_version", "cluster"})
    record = _wire(data.draw(model_strategy(event_type)))
    for name in optional:
        earlier = copy.deepcopy(schema)
        del earlier["properties"][name]
        with_field = {**record, name: record.get(name, "a value this copy never saw")}
        assert _errors(earlier, with_field) == [], name


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.type_name)
@BY_SCHEMA
@given(data=st.data())
def test_a_record_missing_any_required_field_is_invalid(event_type: type[Event], data: st.DataObject) -> None:
    schema = _committed(event_type.type_name)
    record = _wire(data.draw(model_strategy(event_type)))
    assert schema["required"], "every event has required fields (event_id at least)"
    for name in schema["required"]:
        without = {k: v for k, v in record.items() if k != name}
        assert any(f"'{name}' is a required property" in e for e in _errors(schema, without)), name


@pytest.mark.parametrize(
    ("type_name", "event", "mutate", "where", "problem"),
    [
        ("log_batch", _batch, lambda d: d.update(job_id=42), "job_id", "is not of type 'string'"),
        ("log_batch", _batch, lambda d: d.update(lines="nope"), "lines", "is not of type 'array'"),
        ("log_batch", _batch, lambda d: d["lines"][0].update(rank=-1), "lines/0/rank", "not valid under any"),
        ("log_batch", _batch, lambda d: d["lines"][0].pop("text"), "lines/0", "'text' is a required property"),
        ("log_batch", _batch, lambda d: d.update(event_time="soon"), "event_time", "is not of type 'number'"),
        ("log_batch", _batch, lambda d: d.update(job_nodes=["gpu01\x1b[2J"]), "job_nodes/0", "does not match"),
        ("log_batch", _batch, lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "schema_version", "was expected"),
        ("incident", _incident, lambda d: d.update(category="cosmic_rays"), "category", "is not one of"),
        ("incident", _incident, lambda d: d.update(confidence="high"), "confidence", "is not of type 'number'"),
    ],
)
def test_what_a_schema_names_stays_checked(  # type: ignore[no-untyped-def]
    type_name: str, event, mutate, where: str, problem: str
) -> None:
    record = _wire(event())
    schema = _committed(type_name)
    assert _errors(schema, record) == []
    mutate(record)
    errors = _errors(schema, record)
    assert any(e.startswith(f"{where}: ") and problem in e for e in errors), errors


def test_the_doc_topic_table_is_the_generated_one() -> None:
    doc = generate.DOC.read_text()
    assert generate.with_topic_table(doc) == doc, "docs/schemas.md's topic table is stale: python -m schemas.generate"
    table = doc.split(generate.TABLE_START)[1].split(generate.TABLE_END)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [t.name for t in ALL_TOPICS]


def test_the_topic_table_says_what_topics_py_says() -> None:
    rows = {line.split("`")[1]: line for line in generate.topic_table().splitlines() if line.startswith("| `")}
    assert "| for ever |" in rows["mode.changes"] and "| `topic_retention_hours` |" in rows["incidents"]
    assert "partition 0" in rows["action.attempts"].split("|")[4]
    assert "(set by the streams' router)" in rows["anomalies.by_job"]
    assert "[`incident`](../schemas/json/incident.schema.json)" in rows["incidents.by_domain"]


def test_a_doc_without_the_table_markers_is_refused() -> None:
    with pytest.raises(ConfigError, match="markers"):
        generate.with_topic_table("# no table here\n")


def test_the_tables_retention_is_what_topic_creation_sets() -> None:
    from bus.admin import topic_configs

    configs = topic_configs(168)
    rows = {line.split("`")[1]: line for line in generate.topic_table().splitlines() if line.startswith("| `")}
    for name, line in rows.items():
        forever = configs[name]["retention.ms"] == "-1"
        assert line.endswith("| for ever |") == forever, name
        assert configs[name]["retention.ms"] == ("-1" if forever else str(168 * 3600 * 1000)), name
    assert [n for n, line in rows.items() if line.endswith("| for ever |")] == ["mode.changes"]
