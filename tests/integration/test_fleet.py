"""Fleet incidents through the real streams worker and broker (#20 item 3): NVLink Xids (Xid 74,
interconnect, the node's own fault) in the kernel logs of two nodes under one leaf switch of a
topology.conf become, besides each node's incident, ONE fleet incident on the switch, recommended
for repair; a node under another switch does not join it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from sinks.backends.simulated import SimulatedScheduler
from streams.policy import DEFAULT_POLICY
from tests.conftest import wait_for
from tests.integration.scenario import xid79_line
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

TOPOLOGY = "SwitchName=leaf1 Nodes=gpu[01-02]\nSwitchName=leaf2 Nodes=gpu[03-04]\nSwitchName=spine Switches=leaf[1-2]\n"


def xid74_line(node: str) -> str:
    # The Xid 79 fixture line (tests/fixtures/logs/xid79_kern.log) as an NVLink error, Xid 74.
    line = xid79_line(node)
    return line.replace("): 79,", "): 74,").replace(
        "GPU has fallen off the bus.", "NVLINK: fatal error detected on link 2"
    )


def test_two_nodes_under_one_leaf_switch_are_one_fleet_incident(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    conf = tmp_path / "topology.conf"
    conf.write_text(TOPOLOGY)
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data["fleet"] = {"topology_file": str(conf), "window_s": 600, "min_nodes": 2}
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(data))
    stack = Stack(
        StackConfig(
            data_dir=tmp_path / "stack",
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            policy=policy,
            settle_s=1.0,
            collateral_wait_s=3.0,
        ),
        SimulatedScheduler(["gpu01", "gpu02", "gpu03", "gpu04"]),
    ).start()
    try:
        store = stack.store
        assert store is not None
        pub = Publisher(broker.bootstrap, "test-kernel")
        for node in ("gpu01", "gpu03", "gpu02"):
            kern = tmp_path / f"{node}.kern.log"
            kern.write_text(xid74_line(node) + "\n")
            KernelLogProducer(pub, kern, node=node, from_start=True).poll_once()
        assert pub.flush(10) == 0
        pub.close()

        def incidents() -> list[dict[str, object]] | None:
            rows = store.query(
                "SELECT incident_id, culprit_node, category, domain, domain_nodes, explanation "
                "FROM {db}.incidents FINAL ORDER BY event_time"
            )
            return rows if len(rows) >= 4 else None

        rows = wait_for("three node incidents and the fleet incident", incidents, timeout=120)
        assert sorted(str(r["culprit_node"]) for r in rows if r["domain"] is None) == ["gpu01", "gpu02", "gpu03"]
        fleet = [r for r in rows if r["domain"] is not None]
        assert len(fleet) == 1, rows
        assert (fleet[0]["domain"], fleet[0]["domain_nodes"], fleet[0]["category"]) == (
            "switch:leaf1",
            ["gpu01", "gpu02"],
            "interconnect",
        )
        assert "2 nodes under switch:leaf1 (gpu01, gpu02)" in str(fleet[0]["explanation"])
        decision = wait_for(
            "the fleet decision",
            lambda: store.query(
                "SELECT action, kind, rule FROM {db}.decisions FINAL WHERE incident_id = {i:String}",
                {"i": fleet[0]["incident_id"]},
            ),
            timeout=60,
        )[0]
        assert (decision["action"], decision["kind"]) == ("none", "recommendation")
        assert decision["rule"] == "fleet: switch:leaf1: repair the shared component"
    finally:
        stack.stop()


def test_an_approved_fleet_drain_recommendation_drains_the_set(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    """Monitor mode: the fleet incident's drain set is a recommendation; an operator's approval
    sends the same set policy would have (the switch's other node, with the repair label)."""
    conf = tmp_path / "topology.conf"
    conf.write_text("SwitchName=leaf1 Nodes=gpu[01-03]\nSwitchName=leaf2 Nodes=gpu04\n")
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data["fleet"] = {"topology_file": str(conf), "action": "drain"}
    data["guardrails"] = {"max_drains_per_window": 10, "max_drain_fraction": 1.0}
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(data))
    sched = SimulatedScheduler(["gpu01", "gpu02", "gpu03", "gpu04"])
    stack = Stack(
        StackConfig(
            data_dir=tmp_path / "stack",
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            policy=policy,
            mode="monitor",
            api_port=0,
            settle_s=1.0,
            collateral_wait_s=3.0,
        ),
        sched,
    ).start()
    try:
        store, api = stack.store, stack.api
        assert store is not None and api is not None
        pub = Publisher(broker.bootstrap, "test-kernel")
        for node in ("gpu01", "gpu02"):
            kern = tmp_path / f"{node}.kern.log"
            kern.write_text(xid74_line(node) + "\n")
            KernelLogProducer(pub, kern, node=node, from_start=True).poll_once()
        assert pub.flush(10) == 0
        pub.close()
        dec = wait_for(
            "the fleet drain recommendation",
            lambda: store.query(
                "SELECT d.decision_id AS decision_id, d.action AS action, d.kind AS kind, i.incident_id AS incident_id "
                "FROM {db}.decisions AS d FINAL JOIN {db}.incidents AS i FINAL ON d.incident_id = i.incident_id "
                "WHERE i.domain IS NOT NULL"
            ),
            timeout=120,
        )[0]
        assert (dec["action"], dec["kind"]) == ("drain", "recommendation")
        assert sched.calls == []
        ok = subprocess.run(
            [sys.executable, "-m", "trainmedic.cli.main", "recommendations", "approve", dec["decision_id"]]
            + ["--data-dir", str(tmp_path / "stack"), "--api", api.url, "--operator", "alice"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ok.returncode == 0, ok.stderr
        result = wait_for(
            "the approved drain set's result",
            lambda: store.query(
                "SELECT * FROM {db}.action_results FINAL WHERE incident_id = {i:String}", {"i": dec["incident_id"]}
            ),
            timeout=60,
        )[0]
        assert result["status"] == "done", result
        gpu03 = sched.node_state("gpu03")
        assert gpu03.drained and f"trainmedic {dec['incident_id']}" in (gpu03.reason or "")
        assert "| repair: switch:leaf1" in (gpu03.reason or "")
        # Only the set: the failed nodes' own incidents are recommendations in monitor mode.
        assert not any(sched.node_state(n).drained for n in ("gpu01", "gpu02", "gpu04"))
    finally:
        stack.stop()
