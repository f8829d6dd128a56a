"""Remediation after a drain on the REAL Slurm 22.05 and 24.11 clusters (#20 item 4).

An Xid 79 (NVIDIA's RESTART_BM bucket) on gpu02 under a policy with remediation enabled: the
running stack drains gpu02, requeues the job elsewhere, and asks Slurm to reboot gpu02 as soon as
it is idle (`scontrol reboot ASAP nextstate=DRAIN`, DOWN on 22.05), once - the attempt is recorded
before the call and the audit holds it - and the node stays out of service. The local nodes are
emulated: nothing reboots, so slurmctld gives up after ResumeTimeout (infra/slurm/start.sh) and
sets the node DOWN; the test waits for that before the cluster is cleaned.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, wait_for
from tests.integration.scenario import NODES, policy_file, publish_cascade, start_stack, wait_incident
from tests.integration.test_slurm_coexistence import _clean, _sh
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm
REBOOTING = {"REBOOT_REQUESTED", "REBOOT_ISSUED"}


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _policy(tmp: Path) -> Path:
    return policy_file(tmp, mode="autonomous", remediation={"enabled": True})


@pytest.mark.slow(
    reason="the emulated node never reboots: slurmctld gives up only after its ResumeTimeout (30 s), which the test "
    "waits out before the cluster is cleaned, on each Slurm version"
)
def test_a_reboot_remediation_is_issued_once_and_audited(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    out = _sh(cluster, "sbatch", "--parsable", "--nodes=3-4", "--requeue", "--output=/dev/null", "--wrap", "sleep 600")
    job = out.strip().split(";")[0]
    wait_for(f"job {job} RUNNING on 4 nodes", lambda: len(backend.job_state(job).nodes) == 4, timeout=60)
    stack = start_stack(broker.bootstrap, chdb_url, database, backend, tmp_path / "stack", policy=_policy(tmp_path))
    try:
        store = stack.store
        assert store is not None
        publish_cascade(broker.bootstrap, tmp_path, job, NODES, culprit="gpu02")
        inc = wait_incident(store, job)
        result = wait_for(
            "the action result",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": inc["incident_id"]}
            ),
            timeout=120,
        )[0]
        assert result["status"] == "done", result
        steps = " | ".join(result["steps"])
        assert "reboot gpu02: requested ASAP (RESTART_BM), back as " in steps, steps
        state = backend.node_state("gpu02")
        assert state.drained or state.state == "DOWN"
        assert str(inc["incident_id"]) in (state.reason or "") and "reboot (RESTART_BM)" in (state.reason or "")
        attempts = wait_for(
            "the attempts in the audit",
            lambda: (
                (
                    rows := store.query(
                        "SELECT call FROM {db}.action_attempts FINAL WHERE incident_id = {i:String} ORDER BY event_time",
                        {"i": inc["incident_id"]},
                    )
                )
                and "reboot" in [r["call"] for r in rows]
                and rows
            ),
            timeout=60,
        )
        assert [r["call"] for r in attempts] == ["drain", "requeue", "reboot"]
        after = backend.job_state(job)
        assert after.state == "RUNNING" and "gpu02" not in after.nodes
    finally:
        stack.stop()
        # Nothing reboots an emulated node: wait for slurmctld to give up (DOWN) before cleaning.
        wait_for(
            "gpu02's reboot over",
            lambda: not REBOOTING & set(backend.node_state("gpu02").flags),
            timeout=120,
            interval=1.0,
        )
