"""Coexistence with other remediators, on the REAL Slurm 22.05 and 24.11 clusters.

Someone else's drain (NHC, an admin, NVSentinel: a reason without trainmedic's
incident prefix) becomes a scheduler event with its reason, author and time;
trainmedic neither overwrites it (the backend refuses the drain before calling
Slurm) nor resumes it (`trainmedic nodes resume`'s API refuses), and readiness counts
it as a miss - unless it is planned maintenance: the node is in an active MAINT
reservation, or the reason matches a maintenance pattern. An action on a node
in a MAINT reservation is suppressed: the executor reports it ``skipped`` with
the reason, so the audit has it.

Every test starts and ends with no job of root's, no test reservation and
gpu01..gpu04 idle, undrained.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bus.publish import Publisher
from producers.slurm import SlurmProducer, parse_sinfo
from schemas.events import Action, SchedEvent, incident_in_reason
from schemas.topics import SCHED_EVENTS
from sinks.audit import AuditStore
from sinks.audit_schema import SCHED_EVENTS_T
from sinks.backends.base import ActionRefused
from sinks.backends.slurm_cli import SlurmCliBackend
from sinks.executor import Executor, ExecutorSettings
from streams.policy import DEFAULT_POLICY, load_policy
from tests.conftest import Cluster, read_topic, wait_for
from trainmedic.ops.readiness import readiness
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.web.api import create_api

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
NHC = "NHC: ECC errors"
RESV_PREFIX = "tm-coexist-"


def _sh(cluster: Cluster, *argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=cluster.env(), timeout=30, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


def _clean(cluster: Cluster) -> None:
    for line in _sh(cluster, "scontrol", "show", "reservation", "-o").splitlines():
        name = line.split(" ", 1)[0].removeprefix("ReservationName=")
        if name.startswith(RESV_PREFIX):
            _sh(cluster, "scontrol", "delete", f"reservation={name}")
    _sh(cluster, "scancel", "--user", "root")
    nodes = parse_sinfo(json.loads(_sh(cluster, "sinfo", "--json")))
    for name in NODES:
        if nodes[name].state == "DOWN" or "DRAIN" in nodes[name].flags:
            _sh(cluster, "scontrol", "update", f"nodename={name}", "state=resume")

    def idle() -> bool:
        now = parse_sinfo(json.loads(_sh(cluster, "sinfo", "--json")))
        return all(now[n].state == "IDLE" and not now[n].flags for n in NODES)

    wait_for("all nodes idle and unflagged", idle, timeout=60)


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _maint_reservation(cluster: Cluster, nodes: str) -> str:
    name = f"{RESV_PREFIX}{uuid.uuid4().hex[:6]}"
    _sh(
        cluster,
        "scontrol",
        "create",
        "reservation",
        f"reservationname={name}",
        "starttime=now",
        "duration=30",
        "flags=maint,ignore_jobs",
        f"nodes={nodes}",
        "users=root",
    )
    return name


def _drain_action(node: str) -> Action:
    """A drain of `node` its own kernel/GPU report asked for (no job to requeue)."""
    now = time.time()
    return Action(
        event_id=f"act-coexist-{node}",
        event_time=now,
        action_id=f"act-coexist-{node}",
        decision_id=f"dec-coexist-{node}",
        incident_id="inc-0123456789abcdef0123",
        node=node,
        partition="gpu",
        action="drain_and_requeue",
        reason="trainmedic inc-0123456789abcdef0123: gpu_hardware",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now,
        node_reported_fault=True,
    )


def test_someone_elses_drain_is_an_event_left_alone_and_a_miss_unless_maintenance(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    publisher = Publisher(broker.bootstrap, "test-coexistence")
    producer = SlurmProducer(publisher, runner=cluster.runner(), interval_s=1.0, state_path=tmp_path / "state.json")
    since = time.time() - 5
    assert [e.state for e in producer.poll_once()] == ["SNAPSHOT"]  # cold start: the baseline

    # Three drains by someone else: a fault (gpu03), one inside planned maintenance (gpu04, in a
    # MAINT reservation), one whose reason says it is planned (gpu01, a maintenance pattern).
    resv = _maint_reservation(cluster, "gpu02,gpu04")
    _sh(cluster, "scontrol", "update", "nodename=gpu03", "state=drain", f"reason={NHC}")
    _sh(cluster, "scontrol", "update", "nodename=gpu04", "state=drain", f"reason={NHC}")
    _sh(cluster, "scontrol", "update", "nodename=gpu01", "state=drain", "reason=reboot for the new driver")
    t_drain = time.time()

    seen: list[SchedEvent] = []

    def drains() -> dict[str, SchedEvent] | None:
        seen.extend(producer.poll_once())
        got = {e.node: e for e in seen if e.kind == "node" and "DRAIN" in e.flags and e.node}
        return got if {"gpu01", "gpu03", "gpu04"} <= set(got) and any(e.node == "gpu02" for e in seen) else None

    got = wait_for("the three drain events and gpu02's maintenance", drains, timeout=60, interval=0.5)
    gpu03 = got["gpu03"]
    assert (gpu03.reason, gpu03.reason_user, gpu03.reservation) == (NHC, "root", None)
    assert incident_in_reason(gpu03.reason) is None  # not ours
    assert gpu03.reason_time is not None and abs(gpu03.reason_time - t_drain) < 30
    assert gpu03.event_time == gpu03.reason_time  # when the drain happened, per Slurm
    assert "MAINTENANCE" not in gpu03.flags
    gpu04 = got["gpu04"]
    assert (gpu04.reason, gpu04.reservation) == (NHC, resv) and "MAINTENANCE" in gpu04.flags
    gpu02 = next(e for e in seen if e.node == "gpu02")
    assert (gpu02.reservation, "DRAIN" in gpu02.flags) == (resv, False) and "MAINTENANCE" in gpu02.flags
    assert got["gpu01"].reason == "reboot for the new driver"
    assert producer.failed_polls == {}

    assert publisher.flush(10) == 0
    # The events on the bus carry the new fields too.
    on_bus = [SchedEvent.model_validate_json(raw) for raw in read_topic(broker.bootstrap, SCHED_EVENTS.name)]
    assert any(e.node == "gpu03" and e.reason_user == "root" and e.reason == NHC for e in on_bus)

    # trainmedic's backend never overwrites their drain, nor drains a node in maintenance.
    backend = SlurmCliBackend(cluster.runner())
    with pytest.raises(ActionRefused, match=r"already drained \(reason 'NHC: ECC errors' by root\)"):
        backend.drain_node("gpu03", "trainmedic inc-0123456789abcdef0123: gpu_hardware")
    with pytest.raises(ActionRefused, match=f"maintenance reservation {resv}"):
        backend.drain_node("gpu02", "trainmedic inc-0123456789abcdef0123: gpu_hardware")
    # The executor, given a drain of gpu03, leaves their drain alone and says whose it is.
    result = Executor(backend).execute(_drain_action("gpu03"), lambda a, call: pytest.fail(f"{call} called"))
    assert result.status == "done" and f"already drained by someone else ({NHC} by root)" in " ".join(result.steps)
    after = backend.node_state("gpu03")
    assert (after.reason, after.reason_user) == (NHC, "root")
    assert not backend.node_state("gpu02").drained

    # ...nor resumes it: `trainmedic nodes resume` goes through this API call.
    store = AuditStore(chdb_url, database)
    try:
        store.migrate()
        api = create_api(
            store,
            publisher,
            "op-token",
            backend,
            DEFAULT_POLICY,
            tmp_path / "modes.yaml",
        )
        with TestClient(api) as client:
            r = client.post(
                "/api/nodes/gpu03/resume", json={"operator": "alice"}, headers={"Authorization": "Bearer op-token"}
            )
        assert r.status_code == 409 and "drained by someone else ('NHC: ECC errors')" in r.json()["detail"]
        assert backend.node_state("gpu03").reason == NHC  # still theirs, still drained

        # Readiness: the NHC drain of gpu03 is a miss (no incident of ours explains it); the drain
        # inside the MAINT reservation and the reboot are planned work, no misses.
        events = [e for e in seen if e.kind == "node"]
        store.insert("sched_events", [SCHED_EVENTS_T.row(e) for e in events], SCHED_EVENTS_T.column_names)
        scores = {(s.category, s.partition): s for s in readiness(store, load_policy(), since)}
        assert scores[("node", None)].misses == 1
        # The audit keeps whose reason it was, since when, and the maintenance reservation.
        audited = {
            r["node"]: r
            for r in store.query(
                "SELECT node, reason_user, reason_time, reservation FROM {db}.sched_events FINAL "
                "WHERE kind = 'node' ORDER BY event_time"
            )
        }
        assert audited["gpu03"]["reason_user"] == "root" and audited["gpu03"]["reason_time"] is not None
        assert audited["gpu02"]["reservation"] == resv
    finally:
        store.close()
        publisher.close()


def test_action_on_a_node_in_maintenance_is_suppressed_with_the_reason(cluster: Cluster) -> None:
    resv = _maint_reservation(cluster, "gpu02")
    backend = SlurmCliBackend(cluster.runner())
    before = backend.node_state("gpu02")
    executor = Executor(backend, ExecutorSettings(verify_timeout_s=20))
    calls: list[str] = []
    result = executor.execute(_drain_action("gpu02"), lambda a, call: calls.append(call))
    assert result.status == "skipped" and result.verified_at is None
    assert result.error is not None and f"maintenance reservation {resv}" in result.error
    assert any(s.startswith("refused: ") and resv in s for s in result.steps)
    # Slurm was never asked: not drained, its reason untouched. (Its flags may have changed meanwhile:
    # slurmctld sets MAINTENANCE and RESERVED itself at its next periodic reservation check.)
    after = backend.node_state("gpu02")
    assert not before.drained and not after.drained and after.reason == before.reason

    # A node someone else put DOWN is not acted on either.
    _sh(cluster, "scontrol", "update", "nodename=gpu01", "state=down", "reason=admin: bad PSU")
    with pytest.raises(ActionRefused, match=r"gpu01: it is DOWN.*admin: bad PSU"):
        backend.drain_node("gpu01", "trainmedic inc-0123456789abcdef0123: gpu_hardware")
    assert backend.node_state("gpu01").reason == "admin: bad PSU"
