from __future__ import annotations

import orjson
import pytest

from schemas import generate
from schemas.codec import DecodeError, decode, encode
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, KernelEvent, LogBatch, LogLine
from schemas.topics import ALL_TOPICS, JOB_LOGS, NODE_KERNEL, partition_key


def test_json_schema_files_are_current() -> None:
    for name, text in generate.render().items():
        path = generate.OUT_DIR / name
        assert path.exists(), f"schemas/json/{name} missing: run python -m schemas.generate"
        assert path.read_text() == text, f"schemas/json/{name} is stale: run python -m schemas.generate"
    assert len(list(generate.OUT_DIR.glob("*.schema.json"))) == len(EVENT_TYPES)


def test_every_event_type_has_one_topic() -> None:
    carried = {t.event_type for t in ALL_TOPICS}
    assert carried == set(EVENT_TYPES)
    assert len({t.name for t in ALL_TOPICS}) == len(ALL_TOPICS)


def _batch() -> LogBatch:
    return LogBatch(
        event_id="log-1",
        event_time=1.0,
        job_id="42",
        source="/x/out",
        job_nodes=["gpu01"],
        lines=[LogLine(text="hello", ts=1.0, rank=3, node="gpu01", lineno=1)],
    )


def test_roundtrip_and_keys() -> None:
    batch = _batch()
    assert decode(LogBatch, encode(batch)) == batch
    assert partition_key(batch) == b"42"
    kev = KernelEvent(event_id="k", event_time=1.0, node="gpu02", kind="xid", xid=79, text="x")
    assert partition_key(kev) == b"gpu02"
    assert JOB_LOGS.event_type is LogBatch and NODE_KERNEL.event_type is KernelEvent


@pytest.mark.parametrize(
    ("mutate", "field", "problem"),
    [
        (lambda d: d.pop("job_id"), "job_id", "Field required"),
        (lambda d: d.update(lines="nope"), "lines", "valid list"),
        (lambda d: d["lines"][0].update(rank=-1), "lines.0.rank", "greater than or equal"),
        (
            lambda d: d.update(schema_version=SCHEMA_VERSION + 1),
            "schema_version",
            f"unsupported version {SCHEMA_VERSION + 1}",
        ),
        (lambda d: d.update(surprise=1), "surprise", "Extra inputs"),
    ],
)
def test_malformed_payload_names_the_field(mutate, field: str, problem: str) -> None:  # type: ignore[no-untyped-def]
    data = orjson.loads(encode(_batch()))
    mutate(data)
    with pytest.raises(DecodeError) as err:
        decode(LogBatch, orjson.dumps(data))
    assert err.value.field == field
    assert problem in err.value.problem
    assert field in str(err.value)


@pytest.mark.parametrize("payload", [b"{not json", b"[1,2]", b"\xff\xfe", b""])
def test_non_json_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError) as err:
        decode(LogBatch, payload)
    assert err.value.field == "<payload>"
