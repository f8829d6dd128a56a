"""Fleet incidents (#20 item 3): topology from topology.conf and the policy, and the correlation
of node incidents by domain."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.events import Evidence, Incident
from slurmio.topology import TopologyError, parse_topology_conf
from streams.fleet import DomainCorrelator, build_topology, watched
from streams.policy import FleetPolicy, PolicyError, decide, parse_policy

TOPOLOGY = """
# two leaves under one spine
SwitchName=leaf1 Nodes=gpu[01-02] LinkSpeed=200
SwitchName=leaf2 Nodes=gpu[03-04]
SwitchName=spine Switches=leaf[1-2]
"""


def node_incident(node: str, at: float, n: int, category: str = "interconnect") -> Incident:
    return Incident(
        event_id=f"inc-{n}",
        incident_id=f"inc-{n}",
        event_time=at + 1,
        job_id=f"j{n}",
        partition="gpu",
        category=category,  # type: ignore[arg-type]
        severity="critical",
        culprit_node=node,
        confidence=0.9,
        isolate=True,
        explanation="Xid 74",
        anomaly_ids=[f"a{n}"],
        first_signal_time=at,
        evidence=[
            Evidence(source="kernel", signature="xid_74", node=node, time=at, line=f"Xid 74 on {node}", role="root")
        ],
    )


def test_topology_conf_leaves_and_refusals(tmp_path: Path) -> None:
    assert parse_topology_conf(TOPOLOGY) == {"leaf1": ["gpu01", "gpu02"], "leaf2": ["gpu03", "gpu04"]}
    with pytest.raises(TopologyError, match="line 1: expected SwitchName"):
        parse_topology_conf("Nodes=gpu01\n", "t.conf")
    with pytest.raises(TopologyError, match="line 1: switch s has neither"):
        parse_topology_conf("SwitchName=s LinkSpeed=1\n", "t.conf")
    with pytest.raises(TopologyError, match="line 2: switch a is defined twice"):
        parse_topology_conf("SwitchName=a Nodes=n1\nSwitchName=a Nodes=n2\n", "t.conf")
    conf = tmp_path / "topology.conf"
    conf.write_text(TOPOLOGY)
    topo = build_topology(FleetPolicy(topology_file=conf, domains={"rack7": "gpu[02-03]"}))
    assert topo.domains_of("gpu02") == ["switch:leaf1", "rack7"]
    assert topo.nodes_of["rack7"] == ["gpu02", "gpu03"]


def test_a_bad_domain_hostlist_is_refused_naming_the_field() -> None:
    text = "mode: monitor\nactions: {gpu_hardware: drain_and_requeue, node: drain_and_requeue, interconnect: requeue, "
    text += "hang: requeue, user_code: stop, oom: stop, numerical: stop, storage: stop, healthy: none}\n"
    with pytest.raises(PolicyError, match="field 'fleet.domains'.*rack1"):
        parse_policy(text + "fleet: {domains: {rack1: 'gpu[01-'}}\n")


def test_nodes_of_one_domain_failing_together_are_one_fleet_incident() -> None:
    fleet = FleetPolicy(window_s=600, min_nodes=2)
    c = DomainCorrelator()
    nodes = ["gpu01", "gpu02", "gpu03"]
    assert c.observe("switch:leaf1", node_incident("gpu01", 100.0, 1), fleet, nodes) is None
    # The same node again is no second node.
    assert c.observe("switch:leaf1", node_incident("gpu01", 150.0, 2), fleet, nodes) is None
    found = c.observe("switch:leaf1", node_incident("gpu02", 200.0, 3), fleet, nodes)
    assert found is not None and found.domain == "switch:leaf1" and found.domain_nodes == nodes
    assert found.first_signal_time == 100.0 and found.culprit_node is None and found.job_id is None
    assert "2 nodes under switch:leaf1 (gpu01, gpu02)" in found.explanation
    assert {e.node for e in found.evidence} == {"gpu01", "gpu02"}
    # A third node within the window: still that one incident.
    assert c.observe("switch:leaf1", node_incident("gpu03", 300.0, 4), fleet, nodes) is None
    # Past the window, two fresh nodes: a new one.
    assert c.observe("switch:leaf1", node_incident("gpu01", 2000.0, 5), fleet, nodes) is None
    again = c.observe("switch:leaf1", node_incident("gpu03", 2100.0, 6), fleet, nodes)
    assert again is not None and again.incident_id != found.incident_id


def test_faults_too_far_apart_are_no_fleet_incident() -> None:
    fleet = FleetPolicy(window_s=60, min_nodes=2)
    c = DomainCorrelator()
    assert c.observe("rack1", node_incident("gpu01", 100.0, 1), fleet, ["gpu01", "gpu02"]) is None
    assert c.observe("rack1", node_incident("gpu02", 200.0, 2), fleet, ["gpu01", "gpu02"]) is None


def test_only_node_incidents_of_watched_categories_count() -> None:
    fleet = FleetPolicy()
    assert watched(fleet, node_incident("gpu01", 1.0, 1))
    assert not watched(fleet, node_incident("gpu01", 1.0, 1, category="gpu_hardware"))
    assert not watched(fleet, node_incident("gpu01", 1.0, 1).model_copy(update={"isolate": False}))


def test_policy_recommends_the_component_for_repair_and_acts_on_nothing() -> None:
    policy = parse_policy(
        "mode: autonomous\nactions: {gpu_hardware: drain_and_requeue, node: drain_and_requeue, interconnect: "
        "drain_and_requeue, hang: requeue, user_code: stop, oom: stop, numerical: stop, storage: stop, healthy: none}\n"
    )
    c = DomainCorrelator()
    fleet = FleetPolicy()
    c.observe("switch:leaf1", node_incident("gpu01", 1.0, 1), fleet, ["gpu01", "gpu02"])
    found = c.observe("switch:leaf1", node_incident("gpu02", 2.0, 2), fleet, ["gpu01", "gpu02"])
    assert found is not None
    decision, action = decide(policy, found, 10.0)
    assert action is None and not decision.executed and decision.action == "none"
    assert decision.rule == "fleet: switch:leaf1: repair the shared component"
    assert "its nodes: gpu01, gpu02" in decision.reason


def test_a_late_incident_does_not_link_faults_far_apart() -> None:
    fleet = FleetPolicy(window_s=600, min_nodes=2)
    c = DomainCorrelator()
    assert c.observe("rack1", node_incident("gpu02", 5000.0, 1), fleet, ["gpu01", "gpu02"]) is None
    # Arrives later, happened 4,900 s earlier: outside the window of the fault seen first.
    assert c.observe("rack1", node_incident("gpu01", 100.0, 2), fleet, ["gpu01", "gpu02"]) is None
