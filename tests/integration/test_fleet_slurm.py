"""Fleet incidents against the REAL Slurm 22.05 and 24.11 clusters' own topology (#20 item 3).

The local clusters run topology/tree (infra/slurm/start.sh): leaf1 holds gpu01-03, leaf2 gpu04.
The policy reads the very topology.conf slurmctld reads. NVLink Xids (Xid 74, interconnect, the
node's own fault) on idle gpu01 and gpu02 drain each node for its own incident, and make ONE fleet
incident on switch:leaf1. With `fleet.action: drain` in autonomy its drain set takes gpu03 out too
(a job running there runs on: DRAIN lets it end), with a reason naming the fleet incident and the
repair; gpu04, under the other switch, is untouched. A set over the blast radius is refused as a
whole: a guardrail trip, and gpu03 stays in service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from sinks.audit import AuditStore
from sinks.backends.slurm_cli import SlurmCliBackend
from slurmio.topology import parse_topology_conf
from tests.conftest import Cluster, wait_for
from tests.integration.scenario import policy_file, start_stack
from tests.integration.test_fleet import xid74_line
from tests.integration.test_slurm_coexistence import _clean, _sh
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _topology_conf(cluster: Cluster) -> Path:
    return Path(cluster.slurm_conf).parent / "topology.conf"


def test_the_topology_trainmedic_reads_is_the_one_slurmctld_uses(cluster: Cluster) -> None:
    from_file = parse_topology_conf(_topology_conf(cluster).read_text(), "topology.conf")
    from_slurm = parse_topology_conf(_sh(cluster, "scontrol", "show", "topology"), "scontrol show topology")
    assert from_file == from_slurm == {"leaf1": ["gpu01", "gpu02", "gpu03"], "leaf2": ["gpu04"]}


def _faults(bootstrap: str, tmp: Path, nodes: tuple[str, ...]) -> None:
    pub = Publisher(bootstrap, "test-kernel")
    for node in nodes:
        kern = tmp / f"{node}.kern.log"
        kern.write_text(xid74_line(node) + "\n")
        KernelLogProducer(pub, kern, node=node, from_start=True).poll_once()
    assert pub.flush(10) == 0
    pub.close()


def _fleet_incident(store: AuditStore) -> dict[str, Any]:
    rows = wait_for(
        "the fleet incident",
        lambda: store.query("SELECT * FROM {db}.incidents FINAL WHERE domain IS NOT NULL"),
        timeout=120,
    )
    assert len(rows) == 1, rows
    return rows[0]


def _policy(tmp: Path, cluster: Cluster, max_drains: int) -> Path:
    return policy_file(
        tmp,
        mode="autonomous",
        fleet={"topology_file": str(_topology_conf(cluster)), "action": "drain", "window_s": 600, "min_nodes": 2},
        guardrails={"max_drains_per_window": max_drains, "max_drain_fraction": 1.0, "node_cooldown_s": 0},
    )


def test_a_switch_fault_drains_the_switchs_nodes_as_one_set(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    job = _sh(cluster, "sbatch", "--parsable", "-w", "gpu03", "--output=/dev/null", "--wrap", "sleep 600").strip()
    wait_for(f"job {job} RUNNING on gpu03", lambda: backend.job_state(job).state == "RUNNING", timeout=60)
    policy = _policy(tmp_path, cluster, max_drains=10)
    stack = start_stack(broker.bootstrap, chdb_url, database, backend, tmp_path / "stack", policy=policy)
    try:
        store = stack.store
        assert store is not None
        _faults(broker.bootstrap, tmp_path, ("gpu01", "gpu02"))
        fleet = _fleet_incident(store)
        assert (fleet["domain"], fleet["domain_nodes"]) == ("switch:leaf1", ["gpu01", "gpu02", "gpu03"])
        result = wait_for(
            "the drain set's result",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": fleet["incident_id"]}
            ),
            timeout=120,
        )[0]
        assert result["status"] == "done", result
        gpu03 = backend.node_state("gpu03")
        assert gpu03.drained and gpu03.reason is not None
        assert gpu03.reason.startswith(f"trainmedic {fleet['incident_id']}: interconnect")
        assert "repair: switch:leaf1" in gpu03.reason
        # DRAIN, not DOWN: the job on gpu03 runs on until it ends.
        assert backend.job_state(job).state == "RUNNING"
        # gpu01 and gpu02 keep their own incidents' drains; the set drained only gpu03.
        for node in ("gpu01", "gpu02"):
            reason = backend.node_state(node).reason or ""
            assert reason.startswith("trainmedic inc-") and fleet["incident_id"] not in reason
        attempts = store.query(
            "SELECT node, call FROM {db}.action_attempts FINAL WHERE incident_id = {i:String}",
            {"i": fleet["incident_id"]},
        )
        assert [(r["node"], r["call"]) for r in attempts] == [("gpu03", "drain")]
        gpu04 = backend.node_state("gpu04")
        assert not gpu04.drained, gpu04
    finally:
        stack.stop()


def test_a_drain_set_over_the_cap_is_refused_as_a_whole(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    # The nodes' own incidents drain nothing here (interconnect: none), so the set's check does not
    # race their drains: gpu04, drained by an admin, and gpu03 would be 2 of the 4 nodes, over 25 %.
    _sh(cluster, "scontrol", "update", "nodename=gpu04", "state=drain", "reason=admin: cable check")
    policy = _policy(tmp_path, cluster, max_drains=10)
    data = yaml.safe_load(policy.read_text())
    data["actions"]["interconnect"] = "none"
    data["guardrails"]["max_drain_fraction"] = 0.25
    policy.write_text(yaml.safe_dump(data))
    stack = start_stack(broker.bootstrap, chdb_url, database, backend, tmp_path / "stack", policy=policy)
    try:
        store = stack.store
        assert store is not None
        _faults(broker.bootstrap, tmp_path, ("gpu01", "gpu02"))
        fleet = _fleet_incident(store)
        trip = wait_for(
            "the guardrail trip",
            lambda: store.query(
                "SELECT guardrail, detail FROM {db}.guardrail_trips FINAL WHERE incident_id = {i:String}",
                {"i": fleet["incident_id"]},
            ),
            timeout=120,
        )[0]
        assert trip["guardrail"] == "blast_radius" and "refused as a whole" in trip["detail"], trip
        assert "2 of 4 nodes of partition gpu" in trip["detail"], trip
        assert not any(backend.node_state(n).drained for n in ("gpu01", "gpu02", "gpu03"))
        assert backend.node_state("gpu04").reason == "admin: cable check"
    finally:
        stack.stop()
