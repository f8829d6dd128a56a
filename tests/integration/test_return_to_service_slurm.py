"""Validated return to service on the REAL Slurm 22.05 and 24.11 clusters (#20 items 3 and 4).

The operator API's resume (`trainmedic nodes resume`) of a node trainmedic drained runs the
policy's health check over SSH (a real sshd on 127.0.0.1; the "diagnostic" fails while a marker
file for the node exists) and resumes the node in Slurm only when it passes; a lemon (two
isolating faults in the window) stays drained whatever its check says, relabelled for repair in
Slurm. Every verdict is published on node.returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from bus.publish import Publisher
from schemas.codec import decode
from schemas.events import Evidence, Incident, NodeReturn
from schemas.topics import NODE_RETURNS
from sinks.audit import AuditStore
from sinks.audit_schema import INCIDENTS_T
from sinks.backends.slurm_cli import SlurmCliBackend
from streams.policy import DEFAULT_POLICY
from tests.conftest import Cluster, read_topic, wait_for
from tests.integration.test_slurm_coexistence import _clean
from tests.integration.test_slurm_ssh import SshServer, sshd  # noqa: F401 (the module's sshd fixture)
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.web.api import create_api

pytestmark = pytest.mark.slurm
HEADERS = {"Authorization": "Bearer op-token"}


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _incident(incident_id: str, node: str, at: float) -> Incident:
    return Incident(
        event_id=incident_id,
        incident_id=incident_id,
        event_time=at,
        job_id="77",
        partition="gpu",
        category="gpu_hardware",
        severity="critical",
        culprit_node=node,
        confidence=0.95,
        isolate=True,
        explanation="Xid 79 on the node",
        anomaly_ids=["a"],
        first_signal_time=at - 1,
        evidence=[Evidence(source="kernel", signature="xid_79", node=node, time=at - 1, line="l", role="root")],
    )


def _policy(tmp: Path, ssh: SshServer) -> Path:
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data["return_to_service"] = {
        # The node's diagnostic over SSH; it fails while <work>/broken-<node> exists.
        "health_check": [
            "ssh",
            "-p",
            str(ssh.port),
            "-i",
            str(ssh.user_key),
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={ssh.known_hosts}",
            f"{ssh.user}@{ssh.host}",
            f"test ! -e {tmp}/broken-{{node}} || {{ echo 'dcgmi diag: GPU 3 memory test FAIL'; exit 1; }}",
        ],
        "timeout_s": 60,
        "lemon_faults": 2,
        "lemon_window_days": 7,
    }
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_resume_runs_the_health_check_over_ssh_and_a_lemon_stays_drained(
    broker: EmbeddedBroker,
    cluster: Cluster,
    sshd: SshServer,  # noqa: F811
    chdb_url: str,
    database: str,
    tmp_path: Path,
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    store = AuditStore(chdb_url, database)
    publisher = Publisher(broker.bootstrap, "test-api")
    now = time.time()
    try:
        store.migrate()
        # One fault seen by two jobs on the node: two incidents, one fault (not yet a lemon).
        first = [_incident("inc-rts-1", "gpu02", now - 3600), _incident("inc-rts-1b", "gpu02", now - 3590)]
        store.insert("incidents", [INCIDENTS_T.row(i) for i in first], INCIDENTS_T.column_names)
        reason = "trainmedic inc-rts-1: gpu_hardware"
        backend.drain_node("gpu02", reason)
        api = create_api(store, publisher, "op-token", backend, _policy(tmp_path, sshd), tmp_path / "modes.yaml")
        with TestClient(api) as client:
            # The diagnostic fails: the node stays drained, and the answer says why.
            (tmp_path / "broken-gpu02").touch()
            r = client.post("/api/nodes/gpu02/resume", json={"operator": "alice"}, headers=HEADERS)
            assert r.status_code == 409, r.text
            detail = r.json()["detail"]
            assert "health check failed on gpu02" in detail and "GPU 3 memory test FAIL" in detail
            state = backend.node_state("gpu02")
            assert state.drained and state.reason == reason
            # Fixed: the check passes over SSH and Slurm resumes the node.
            (tmp_path / "broken-gpu02").unlink()
            r = client.post("/api/nodes/gpu02/resume", json={"operator": "alice"}, headers=HEADERS)
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "resumed" and "health check passed on gpu02" in r.json()["check"]
            assert not backend.node_state("gpu02").drained
            # Back in service (a resumed node answers its next ping before it takes work).
            wait_for(
                "gpu02 idle and responding",
                lambda: (n := backend.node_state("gpu02")).state == "IDLE" and not n.flags,
                timeout=60,
            )

            # A second isolating fault within the window: a lemon. Its check passes; it stays drained.
            store.insert("incidents", [INCIDENTS_T.row(_incident("inc-rts-2", "gpu02", now))], INCIDENTS_T.column_names)
            backend.drain_node("gpu02", "trainmedic inc-rts-2: gpu_hardware")
            r = client.post("/api/nodes/gpu02/resume", json={"operator": "alice"}, headers=HEADERS)
            assert r.status_code == 409, r.text
            assert "gpu02 is a lemon: 2 isolating faults in 7 days (inc-rts-1, inc-rts-2)" in r.json()["detail"]
            state = backend.node_state("gpu02")
            assert state.drained and state.reason is not None
            assert state.reason.startswith("trainmedic inc-rts-2: gpu_hardware | repair: lemon")
        returns = sorted(
            (decode(NodeReturn, raw) for raw in read_topic(broker.bootstrap, NODE_RETURNS.name)),
            key=lambda e: e.event_time,
        )
        assert [(e.outcome, e.check_passed) for e in returns] == [
            ("refused", False),
            ("resumed", True),
            ("refused", None),
        ]
        assert returns[0].check is not None and returns[0].check.startswith("ssh -p")
    finally:
        publisher.close()
        store.close()
