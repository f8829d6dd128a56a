"""Bad input everywhere, through a real Stack (embedded broker, Faust worker, executor, audit
sink on chDB): every record a component cannot accept becomes a dead letter naming the
component and the problem (in the dead-letter topic and in the audit); odd-but-valid input is
handled explicitly; nothing crashes, and a real fault afterwards is still found and acted on."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import orjson

from bus.publish import Publisher
from schemas.codec import decode, encode
from schemas.events import SCHEMA_VERSION, DeadLetter, KernelEvent, LogBatch, LogLine
from schemas.topics import (
    ACTIONS,
    ANOMALIES,
    DEADLETTER,
    GPU_SAMPLES,
    INCIDENTS,
    JOB_LOGS,
    JOB_PROGRESS,
    NODE_KERNEL,
    SCHED_EVENTS,
)
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from tests.integration.scenario import NODES, incidents_of, publish_cascade
from tests.reliability.harness import read_all, report_row
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

XID79 = "NVRM: Xid (PCI:0000:07:00): 79, pid=1234, name=python, GPU has fallen off the bus."


def _kernel(event_id: str, node: str, t: float | None = None) -> KernelEvent:
    return KernelEvent(
        event_id=event_id,
        event_time=time.time() if t is None else t,
        node=node,
        kind="xid",
        xid=79,
        pci_bus_id="0000:07:00",
        text=XID79,
    )


def _batch(job: str, text: str, event_id: str) -> LogBatch:
    return LogBatch(
        event_id=event_id,
        event_time=time.time(),
        job_id=job,
        source="stdout",
        job_nodes=["gpu05"],
        partition="gpu",
        lines=[LogLine(text=text, ts=time.time(), rank=3, node="gpu05", lineno=1)],
    )


def _with(payload: bytes, **changes: object) -> bytes:
    data = orjson.loads(payload)
    data.update(changes)
    return orjson.dumps(data)


def test_bad_input_is_dead_lettered_or_handled_and_nothing_crashes(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler([*NODES, "gpu05", "gpu06"], requeue_delay_s=0.5)
    job = sched.submit("train", 4)
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="autonomous",
        ),
        sched,
    ).start()
    try:
        store = stack.store
        assert store is not None
        pub = Publisher(broker.bootstrap, "bad-input")
        log_ok = encode(_batch("777", "step 1 loss 2.0", "lb-ok"))
        huge = "x" * 900_000
        # (topic, payload, the components that must refuse it, what the reason must say)
        poisons: list[tuple[str, bytes, set[str], str]] = [
            (
                JOB_LOGS.name,
                b'{"schema_version": 1, "event_id": "x", "lines": "\xff cut',
                {"streams.detect_logs"},
                "JSON",
            ),
            (
                JOB_LOGS.name,
                _with(log_ok, schema_version=SCHEMA_VERSION + 1),
                {"streams.detect_logs"},
                f"unsupported version {SCHEMA_VERSION + 1}",
            ),
            (
                JOB_LOGS.name,
                _with(log_ok, lines=[{"text": huge, "ts": 1.0, "lineno": 0}]),
                {"streams.detect_logs"},
                "payload cut to its first 65536 of",
            ),
            (NODE_KERNEL.name, b"[1, 2, 3]", {"streams.detect_kernel"}, "expected a JSON object"),
            (
                NODE_KERNEL.name,
                _with(encode(_kernel("k-future", "gpu06")), event_id="k-far-future", event_time=1e13),
                {"streams.detect_kernel"},
                "event_time",
            ),
            (
                GPU_SAMPLES.name,
                orjson.dumps(
                    {"schema_version": SCHEMA_VERSION, "event_id": "g", "event_time": -5, "node": "gpu01", "gpus": []}
                ),
                {"streams.detect_gpu"},
                "event_time",
            ),
            (
                SCHED_EVENTS.name,
                b"\xff\xfe\x00 not utf-8",
                {"streams.detect_signals", "streams.attribute", "streams.placements", "sinks.audit"},
                "JSON",
            ),
            (JOB_PROGRESS.name, b"", {"streams.detect_signals"}, "JSON"),
            (
                ANOMALIES.name,
                orjson.dumps({"schema_version": SCHEMA_VERSION}),
                {"streams.attribute", "streams.route", "sinks.audit"},
                "event_id",
            ),
            (
                INCIDENTS.name,
                orjson.dumps({"schema_version": SCHEMA_VERSION, "event_id": 5}),
                {"streams.policy", "sinks.audit"},
                "event_id",
            ),
            (ACTIONS.name, b"\x1b[31mnot an action\x1b[0m", {"sinks.executor", "sinks.audit"}, "JSON"),
        ]
        for i, (topic, payload, _, _) in enumerate(poisons):
            pub.publish_raw(topic, payload, key=f"poison-{i}".encode())

        # Valid but odd: ANSI colours and control characters around a real CUDA error line
        # (still detected), a Xid from a node the scheduler does not know, and an event sent twice.
        ansi = "\x1b[1;31m[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered\x1b[0m\x07\r"
        pub.publish(JOB_LOGS, _batch("778", ansi, "lb-ansi"))
        ghost = _kernel("k-ghost", "ghost-node-17")
        pub.publish(NODE_KERNEL, ghost)
        pub.publish(NODE_KERNEL, ghost)
        assert pub.flush(10) == 0

        # A dead letter is known by who refused what: (component, topic, the bytes it kept).
        # The audit sink IS the audit: its own refusals go straight into the dead_letters table.
        expected = {(comp, topic, payload[:65536]) for topic, payload, comps, _ in poisons for comp in comps}
        on_topic = {k for k in expected if k[0] != "sinks.audit"}
        letters = [
            decode(DeadLetter, v)
            # Until every expected letter is read: the executor's comes after its group join and
            # lease, which on a loaded machine is more than read_all's default 5 s of quiet.
            for v in read_all(broker.bootstrap, DEADLETTER.name, want=len(on_topic), timeout=90, idle_s=90)
        ]
        got = {(d.component, d.original_topic, base64.b64decode(d.payload_b64)): d.reason for d in letters}
        assert set(got) == on_topic, sorted(k[:2] for k in set(got) ^ on_topic)

        def audited() -> dict[tuple[str, str, bytes], str]:
            rows = store.query("SELECT component, original_topic, reason, payload_b64 FROM {db}.dead_letters FINAL")
            return {
                (str(r["component"]), str(r["original_topic"]), base64.b64decode(str(r["payload_b64"]))): str(
                    r["reason"]
                )
                for r in rows
            }

        in_audit = wait_for("every dead letter in the audit", lambda: a if set(a := audited()) >= expected else None)
        assert set(in_audit) == expected, sorted(k[:2] for k in set(in_audit) ^ expected)
        for topic, payload, comps, needle in poisons:
            for comp in comps:
                assert needle in in_audit[(comp, topic, payload[:65536])], (topic, comp)
        # Handled explicitly: the ANSI-wrapped CUDA error is an anomaly of its job ...
        wait_for(
            "the anomaly behind the ANSI colours",
            lambda: store.query("SELECT signature FROM {db}.anomalies FINAL WHERE job_id = '778'"),
        )
        # ... the Xid of an unknown node is one incident (sent twice), whose drain Slurm refuses.
        ghost_incidents = wait_for(
            "the unknown node's incident",
            lambda: store.query("SELECT incident_id FROM {db}.incidents FINAL WHERE culprit_node = 'ghost-node-17'"),
        )
        assert len(ghost_incidents) == 1
        outcome = wait_for(
            "the unknown node's action result or guardrail trip",
            lambda: _outcome(store, str(ghost_incidents[0]["incident_id"])),
        )
        assert outcome in {"failed", "skipped"} or outcome.startswith("trip:"), outcome
        assert not [c for c in sched.calls if "ghost-node-17" in c]

        # Nothing crashed, and a real fault is still found and acted on.
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        wait_for("the real fault's incident", lambda: incidents_of(store, job), timeout=60)
        wait_for("the real fault's requeue", lambda: any(c.startswith(f"requeue {job}") for c in sched.calls))
        stack.check_alive()
        assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]
        report_row(
            f"bad input: {len(poisons)} poison records on 8 topics, ANSI, unknown node, a duplicate",
            sent=len(poisons),
            landed=len(in_audit),
            where="dead letters (one per refusing component)",
            duplicates=len(ghost_incidents) - 1,
            actions_expected=2,
            actions_taken=len(sched.calls),
            note="nothing crashed; a real fault afterwards was drained and requeued",
        )
    finally:
        stack.stop()


def _outcome(store: AuditStore, incident_id: str) -> str | None:
    rows = store.query(
        "SELECT status FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": incident_id}
    )
    if rows:
        return str(rows[0]["status"])
    trips = store.query(
        "SELECT guardrail FROM {db}.guardrail_trips FINAL WHERE incident_id = {i:String}", {"i": incident_id}
    )
    return f"trip:{trips[0]['guardrail']}" if trips else None
