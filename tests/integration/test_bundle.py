"""The incident evidence bundle (trainmedic/ops/bundle.py) on the real chDB audit and the real broker.

One isolating incident, as the pipeline would have recorded it: an Xid 79 on gpu02
(the kernel line of tests/fixtures/logs/xid79_kern.log, as gpu02's journal shows it),
the NCCL watchdog timeout it caused in rank 0 of the job on gpu01
(tests/fixtures/logs/nccl_watchdog_timeout.log), the decision, the drain-and-requeue
and its result, the scheduler's events of gpu02 and of the job - each with rows
outside the window and of other nodes and jobs, which the bundle must leave out.

GPU samples go to the real broker with the record time of a node producer that
publishes each sample when it is taken (record time = sample time), so that the
window and the retention check read what a real topic would hold: `Publisher`
stamps records with the time of publishing, which would put every sample at "now".
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from bus.config import producer_config
from schemas.codec import decode, encode
from schemas.errors import NotFound, UsageError
from schemas.events import (
    Action,
    ActionResult,
    Anomaly,
    Decision,
    Event,
    Evidence,
    GpuMetrics,
    GpuSample,
    Incident,
    SchedEvent,
)
from schemas.topics import GPU_SAMPLES, partition_key
from sinks.audit import AuditStore
from tests.conftest import FIXTURES, new_database_name
from tests.integration.test_audit import insert_events
from trainmedic.ops.bundle import FILES, Bundle, build_bundle, iso, write_bundle
from trainmedic.stack.broker import EmbeddedBroker

INCIDENT = "inc-bundle-xid79"
JOB = "4242"
NODES = ["gpu01", "gpu02", "gpu03", "gpu04"]
T0 = float(int(time.time()) - 3600)  # the Xid: the incident's first signal (whole seconds: Kafka and the audit keep ms)
DETECTED = T0 + 32.0
WINDOW_S = 300.0


def _fixture_line(name: str, needle: str) -> str:
    return next(line for line in (FIXTURES / "logs" / name).read_text().splitlines() if needle in line)


# As gpu02's journal shows it (the fixture was captured on gpu01).
KERN = _fixture_line("xid79_kern.log", "Xid (PCI:0000:10:00): 79").replace(" gpu01 kernel:", " gpu02 kernel:")
NCCL = _fixture_line("nccl_watchdog_timeout.log", "[rank0]:[E1206 18:44:12")
OLD_KERN = "Sep 09 14:00:00 gpu02 kernel: NVRM: an older line, outside the window"
OTHER_NODE_KERN = "Sep 09 15:53:24 gpu03 kernel: NVRM: Xid (PCI:0000:20:00): 31, another node's fault"
OTHER_JOB_LINE = "[rank0]: RuntimeError: another job's error"
DRAIN_REASON = f"trainmedic {INCIDENT}: xid_79 on gpu02"


def _anomaly(eid: str, t: float, *, node: str, line: str, source: str, signature: str, **kw: Any) -> Anomaly:
    return Anomaly(
        event_id=eid,
        event_time=t,
        detector="xid" if source == "kernel" else "signatures",
        signature=signature,
        category=kw.pop("category", "gpu_hardware"),
        severity="critical",
        role=kw.pop("role", "root"),
        source=source,  # type: ignore[arg-type]
        node=node,
        line=line,
        **kw,
    )


def audit_events() -> list[Event]:
    xid = _anomaly("anm-xid", T0, node="gpu02", line=KERN, source="kernel", signature="xid_79", isolate=True)
    nccl = _anomaly(
        "anm-nccl",
        T0 + 30,
        node="gpu01",
        line=NCCL,
        source="job_log",
        signature="nccl_watchdog_timeout",
        category="interconnect",
        role="collateral",
        job_id=JOB,
        rank=0,
        partition="gpu",
        job_nodes=NODES,
    )
    noise = [
        _anomaly("anm-old", T0 - 1000, node="gpu02", line=OLD_KERN, source="kernel", signature="xid_79"),
        _anomaly("anm-gpu03", T0 + 5, node="gpu03", line=OTHER_NODE_KERN, source="kernel", signature="xid_31"),
        _anomaly(
            "anm-other-job",
            T0 + 31,
            node="gpu01",
            line=OTHER_JOB_LINE,
            source="job_log",
            signature="python_traceback",
            category="user_code",
            job_id="999",
        ),
    ]
    incident = Incident(
        event_id=INCIDENT,
        event_time=DETECTED,
        incident_id=INCIDENT,
        job_id=JOB,
        partition="gpu",
        job_nodes=NODES,
        job_name="llama-70b",
        user="alice",
        account="research",
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        confidence=0.95,
        isolate=True,
        explanation="Xid 79 (GPU fallen off the bus) on gpu02; the NCCL watchdog timeouts follow from it",
        evidence=[
            Evidence(source="kernel", signature="xid_79", node="gpu02", time=T0, line=KERN, role="root"),
            Evidence(
                source="job_log",
                signature="nccl_watchdog_timeout",
                node="gpu01",
                rank=0,
                time=T0 + 30,
                line=NCCL,
                role="collateral",
            ),
        ],
        anomaly_ids=["anm-xid", "anm-nccl"],
        first_signal_time=T0,
    )
    common = {"incident_id": INCIDENT, "job_id": JOB, "incident_time": DETECTED, "first_signal_time": T0}
    did: list[Event] = [
        Decision(
            event_id="dec-bundle",
            event_time=DETECTED + 0.01,
            decision_id="dec-bundle",
            partition="gpu",
            category="gpu_hardware",
            culprit_node="gpu02",
            action="drain_and_requeue",
            mode="autonomous",
            executed=True,
            rule="actions.gpu_hardware=drain_and_requeue",
            reason="Xid 79 is a hardware fault of gpu02",
            **common,  # type: ignore[arg-type]
        ),
        Action(
            event_id="act-bundle",
            event_time=DETECTED + 0.02,
            action_id="act-bundle",
            decision_id="dec-bundle",
            node="gpu02",
            partition="gpu",
            action="drain_and_requeue",
            reason=DRAIN_REASON,
            requested_by="policy",
            **common,  # type: ignore[arg-type]
        ),
        ActionResult(
            event_id="res-bundle",
            event_time=DETECTED + 8,
            action_id="act-bundle",
            node="gpu02",
            action="drain_and_requeue",
            status="done",
            backend="slurm_cli",
            steps=["drain gpu02", f"requeue {JOB}"],
            started_at=DETECTED + 0.05,
            verified_at=DETECTED + 8,
            **common,  # type: ignore[arg-type]
        ),
    ]

    def node_event(eid: str, t: float, node: str, state: str, **kw: Any) -> SchedEvent:
        return SchedEvent(event_id=eid, event_time=t, kind="node", node=node, state=state, partition="gpu", **kw)

    def job_event(eid: str, t: float, job: str, state: str, **kw: Any) -> SchedEvent:
        return SchedEvent(
            event_id=eid, event_time=t, kind="job", job_id=job, state=state, nodes=NODES, partition="gpu", **kw
        )

    sched: list[Event] = [
        node_event("sn-old", T0 - 2000, "gpu02", "IDLE"),
        node_event("sn-before", T0 - 400, "gpu02", "ALLOCATED", previous_state="IDLE"),
        node_event(
            "sn-drain",
            DETECTED + 2,
            "gpu02",
            "DRAIN",
            previous_state="ALLOCATED",
            flags=["DRAIN"],
            reason=DRAIN_REASON,
            reason_user="root",
            reason_time=DETECTED + 2,
        ),
        node_event("sn-gpu03", DETECTED + 2, "gpu03", "DOWN", reason="someone else's"),
        job_event("sj-before", T0 - 5000, JOB, "RUNNING", previous_state="PENDING"),
        job_event("sj-requeue", DETECTED + 3, JOB, "PENDING", previous_state="RUNNING", reason="BeginTime"),
        job_event("sj-other", DETECTED + 3, "999", "FAILED"),
    ]
    return [xid, nccl, *noise, incident, *did, *sched]


def sample(eid: str, t: float, node: str, **kw: Any) -> GpuSample:
    gpu = GpuMetrics(index=0, utilization_pct=97.0, temperature_c=71.0, **kw)
    return GpuSample(event_id=eid, event_time=t, node=node, gpus=[gpu])


# Published in time order. The GPU window of WINDOW_S is [T0 - 300, DETECTED + 60].
SAMPLES = [
    sample("gs-gpu02-early", T0 - 400, "gpu02"),  # the oldest record of gpu02: before the window
    sample("gs-gpu05", T0 - 100, "gpu05", error="gpu02"),  # another node (that names gpu02 in its text)
    sample("gs-gpu02-in1", T0 - 100, "gpu02"),
    sample("gs-gpu02-in2", T0 + 1, "gpu02", lost=True, xid_events=[79]),
    sample("gs-gpu02-in2-again", T0 + 1, "gpu02").model_copy(update={"cluster": "other-cluster"}),
    sample("gs-gpu02-late", DETECTED + 200, "gpu02"),  # after the window
]
IN_WINDOW = ["gs-gpu02-in1", "gs-gpu02-in2"]


def publish_samples(bootstrap: str, samples: list[GpuSample]) -> None:
    producer = Producer(producer_config(bootstrap, "trainmedic-test-gpu"))
    for s in samples:
        producer.produce(GPU_SAMPLES.name, value=encode(s), key=partition_key(s), timestamp=int(s.event_time * 1000))
    assert producer.flush(30) == 0, "GPU samples not delivered"


@pytest.fixture(scope="module")
def store(chdb_url: str) -> Iterator[AuditStore]:
    # Read only by its tests (a bundle reads the audit): seeded once per module and worker.
    s = AuditStore(chdb_url, new_database_name())
    try:
        s.migrate()
        insert_events(s, audit_events())
        yield s
    finally:
        s.close()


@pytest.fixture
def bootstrap(broker: EmbeddedBroker) -> str:
    publish_samples(broker.bootstrap, SAMPLES)
    return broker.bootstrap


# --- helpers ----------------------------------------------------------------------


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        out = {}
        for m in tar.getmembers():
            assert m.isfile() and m.mode == 0o644, (m.name, oct(m.mode))
            f = tar.extractfile(m)
            assert f is not None
            out[m.name] = f.read()
        return out


def line_rows(text: bytes) -> list[list[str]]:
    """The data rows of job_log.txt / kernel.txt: 7 fields, then the line verbatim."""
    return [r.split("\t", 7) for r in text.decode().splitlines() if not r.startswith("#")]


def assert_audit_sections(b: Bundle) -> None:
    """Every section the audit gives, as the incident recorded them."""
    inc = b.incident
    assert inc["incident_id"] == INCIDENT and inc["culprit_node"] == "gpu02" and inc["category"] == "gpu_hardware"
    assert [e["line"] for e in inc["evidence"]] == [KERN, NCCL]
    s = b.sections
    assert [d["decision_id"] for d in s["decisions"]] == ["dec-bundle"]
    assert [(a["action_id"], a["node"]) for a in s["actions"]] == [("act-bundle", "gpu02")]
    assert [(r["status"], r["steps"]) for r in s["action_results"]] == [("done", ["drain gpu02", f"requeue {JOB}"])]
    assert s["approvals"] == [] and s["guardrail_trips"] == []
    # The kernel line verbatim, once (the evidence and its anomaly are one row), nothing of other nodes or times.
    assert [(k["line"], k["node"], k["from"]) for k in s["kernel"]] == [(KERN, "gpu02", "evidence+anomaly")]
    assert [(j["line"], j["node"], j["rank"], j["from"]) for j in s["job_log"]] == [
        (NCCL, "gpu01", 0, "evidence+anomaly")
    ]
    # The scheduler's view: the last event before the window and those in it, of gpu02 and of the job only.
    view = [(r["kind"], r["node"] or r["job_id"], r["seen"], r["state"]) for r in s["scheduler"]]
    assert view == [
        ("node", "gpu02", "before", "ALLOCATED"),
        ("node", "gpu02", "window", "DRAIN"),
        ("job", JOB, "before", "RUNNING"),
        ("job", JOB, "window", "PENDING"),
    ]
    drain = s["scheduler"][1]
    assert (drain["flags"], drain["reason"], drain["reason_user"]) == (["DRAIN"], DRAIN_REASON, "root")
    assert abs(datetime.fromisoformat(drain["reason_time"]).timestamp() - (DETECTED + 2)) < 0.002


# --- tests ------------------------------------------------------------------------


def test_bundle_has_every_section_and_the_archive_matches_its_manifest(
    store: AuditStore, bootstrap: str, tmp_path: Path
) -> None:
    now = DETECTED + 600
    b = build_bundle(store, INCIDENT, bootstrap, window_s=WINDOW_S, now=now)
    assert b.gaps == []
    assert_audit_sections(b)
    got = b.sections["gpu_samples"]
    assert [g["event_id"] for g in got] == IN_WINDOW
    assert {g["node"] for g in got} == {"gpu02"}
    assert got[1]["gpus"][0]["lost"] is True and got[1]["gpus"][0]["xid_events"] == [79]

    path = write_bundle(b, tmp_path / "inc.tar.gz")
    files = members(path)
    assert list(files) == list(FILES)
    manifest = orjson.loads(files["manifest.json"])
    assert (manifest["incident_id"], manifest["cluster"], manifest["gaps"]) == (INCIDENT, "default", [])
    assert manifest["created_at"] == iso(now)
    rows = {f["name"]: f.get("rows") for f in manifest["files"]}
    decisions = orjson.loads(files["decisions.json"])
    # Each count the manifest gives is what the file holds.
    assert rows["incident.json"] == 1 and orjson.loads(files["incident.json"])["incident_id"] == INCIDENT
    assert rows["decisions.json"] == sum(len(v) for v in decisions.values()) == 3
    assert next(f for f in manifest["files"] if f["name"] == "decisions.json")["parts"] == {
        k: len(v) for k, v in decisions.items()
    }
    assert rows["job_log.txt"] == len(line_rows(files["job_log.txt"])) == 1
    kernel = line_rows(files["kernel.txt"])
    assert rows["kernel.txt"] == len(kernel) == 1
    assert kernel[0][1] == "gpu02" and kernel[0][-1] == KERN
    assert OLD_KERN.encode() not in files["kernel.txt"] and b"gpu03" not in files["kernel.txt"]
    assert OTHER_JOB_LINE.encode() not in files["job_log.txt"]
    assert rows["scheduler.json"] == len(orjson.loads(files["scheduler.json"])) == 4
    samples = [decode(GpuSample, line) for line in files["gpu_samples.jsonl"].splitlines()]
    assert rows["gpu_samples.jsonl"] == len(samples) == 2
    assert [s.event_id for s in samples] == IN_WINDOW
    readme = files["README.txt"].decode()
    for needle in ("gpu02", "gpu_hardware", "drain_and_requeue", "state DRAIN", DRAIN_REASON, "nothing: every source"):
        assert needle in readme, needle

    # Reproducible: the same evidence made at the same time is the same archive, byte for byte.
    again = build_bundle(store, INCIDENT, bootstrap, window_s=WINDOW_S, now=now)
    assert write_bundle(again, tmp_path / "again.tar.gz").read_bytes() == path.read_bytes()


def test_without_a_broker_the_gpu_samples_are_a_gap_and_the_rest_is_there(store: AuditStore, tmp_path: Path) -> None:
    b = build_bundle(store, INCIDENT, None, window_s=WINDOW_S)
    assert_audit_sections(b)
    assert b.sections["gpu_samples"] == []
    assert len(b.gaps) == 1 and b.gaps[0].startswith("gpu.samples: no broker was given")
    assert "not read" in b.gaps[0]
    files = members(write_bundle(b, tmp_path / "b.tar.gz"))
    assert orjson.loads(files["manifest.json"])["gaps"] == b.gaps
    assert files["gpu_samples.jsonl"] == b""
    assert b.gaps[0] in files["README.txt"].decode()


def test_an_unreachable_broker_is_a_gap(store: AuditStore) -> None:
    b = build_bundle(store, INCIDENT, "127.0.0.1:1", window_s=WINDOW_S, kafka_timeout_s=2.0)
    assert_audit_sections(b)
    assert len(b.gaps) == 1 and b.gaps[0].startswith("gpu.samples: the broker 127.0.0.1:1 could not be read")


def test_samples_no_longer_retained_are_named(store: AuditStore, bootstrap: str) -> None:
    # A window that starts before the oldest record the topic holds of gpu02 (T0 - 400).
    b = build_bundle(store, INCIDENT, bootstrap, window_s=3600.0)
    assert b.gaps == [
        f"gpu.samples: nothing before {iso(T0 - 400)} is retained (retention); the window began {iso(T0 - 3600)}"
        "; it is the topic's first record, so older samples may never have been published"
    ]
    # What is retained is still read.
    assert [g["event_id"] for g in b.sections["gpu_samples"]] == ["gs-gpu02-early", *IN_WINDOW]


def test_refusals(store: AuditStore, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="inc-nope"):
        build_bundle(store, "inc-nope", None)
    b = build_bundle(store, INCIDENT, None, window_s=WINDOW_S)
    with pytest.raises(UsageError, match=r"\.tar\.gz"):
        write_bundle(b, tmp_path / "bundle.zip")
    with pytest.raises(UsageError, match=r"\.tar\.gz"):
        write_bundle(b, tmp_path / "bundle.tar")
    assert not (tmp_path / "bundle.zip").exists() and not (tmp_path / "bundle.tar").exists()
    taken = tmp_path / "taken.tar.gz"
    taken.write_bytes(b"someone else's file")
    with pytest.raises(UsageError, match="exists"):
        write_bundle(b, taken)
    assert taken.read_bytes() == b"someone else's file"
    write_bundle(b, taken, overwrite=True)
    assert orjson.loads(members(taken)["manifest.json"])["incident_id"] == INCIDENT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.tar.gz"]  # no temporary file left
    with tarfile.open(fileobj=io.BytesIO(taken.read_bytes()), mode="r:gz") as tar:
        assert {m.mtime for m in tar.getmembers()} == {int(b.created_at)}


def test_records_that_do_not_decode_are_counted_not_fatal(store: AuditStore, bootstrap: str) -> None:
    producer = Producer(producer_config(bootstrap, "trainmedic-test-gpu"))
    bad = b'{"schema_version": 2, "node": "gpu02", "gpus": "not a list"}'
    producer.produce(GPU_SAMPLES.name, value=bad, key=b"gpu02", timestamp=int((T0 + 2) * 1000))
    assert producer.flush(30) == 0
    b = build_bundle(store, INCIDENT, bootstrap, window_s=WINDOW_S)
    assert b.gaps == ["gpu.samples: 1 record naming gpu02 in the window could not be decoded and were skipped"]
    assert [g["event_id"] for g in b.sections["gpu_samples"]] == IN_WINDOW


# --- the operator's two ways to fetch it ------------------------------------------------


def test_audit_incident_bundle_writes_the_file_and_names_the_gaps(
    store: AuditStore, bootstrap: str, chdb_url: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from trainmedic.cli.audit import audit_app

    out = tmp_path / "hand-off.tar.gz"
    args = ["incident", INCIDENT, "--bundle", str(out), "--clickhouse", chdb_url, "--database", store.database]
    result = CliRunner().invoke(audit_app, [*args, "--bootstrap", bootstrap])
    assert result.exit_code == 0, result.output
    assert f"{out}: " in result.output and "gpu_samples" in result.output
    files = members(out)
    assert orjson.loads(files["manifest.json"])["incident_id"] == INCIDENT
    # Again: the file exists and is not overwritten (exit 2, a usage error naming it).
    again = CliRunner().invoke(audit_app, [*args, "--bootstrap", bootstrap])
    assert again.exit_code == 2, again.output
    assert "exists: not overwritten" in again.output + (again.stderr if again.stderr_bytes is not None else "")


def test_the_console_serves_the_bundle_to_a_token_holder_only(store: AuditStore, bootstrap: str) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from trainmedic.web.console.routes import console_router

    app = FastAPI()
    app.include_router(console_router(store, "tok", None, bootstrap=bootstrap))
    with TestClient(app) as client:
        assert client.get(f"/api/incidents/{INCIDENT}/bundle").status_code == 401
        r = client.get(f"/api/incidents/{INCIDENT}/bundle", headers={"Authorization": "Bearer tok"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
        assert f'filename="{INCIDENT}.tar.gz"' in r.headers["content-disposition"]
        with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
            names = tar.getnames()
        assert "manifest.json" in names and "gpu_samples.jsonl" in names
        missing = client.get("/api/incidents/inc-nope/bundle", headers={"Authorization": "Bearer tok"})
        assert missing.status_code == 404 and "inc-nope" in missing.json()["detail"]
