"""Fleet incidents (#20 item 3): topology from topology.conf and the policy, and the correlation
of node incidents by domain."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.events import Action, ActionAttempt, AttemptCall, Evidence, Incident
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorSettings
from sinks.guardrails import Guardrails, GuardrailSettings
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


NODES = [f"gpu{i:02d}" for i in range(1, 11)]


def rails(sched: SimulatedScheduler, **settings: object) -> Guardrails:
    s = GuardrailSettings.model_validate(settings)
    return Guardrails(lambda: s, sched)


def set_action(nodes: list[str], incident: str = "inc-fleet-1") -> Action:
    return Action(
        event_id=f"act-{incident}",
        event_time=1.0,
        action_id=f"act-{incident}",
        decision_id="dec-1",
        incident_id=incident,
        nodes=nodes,
        partition="gpu",
        action="drain",
        reason=f"trainmedic {incident}: interconnect | repair: switch:leaf1",
        requested_by="policy",
        incident_time=1.0,
        first_signal_time=0.5,
    )


POLICY = (
    "actions: {gpu_hardware: drain_and_requeue, node: drain_and_requeue, interconnect: drain_and_requeue, "
    "hang: requeue, user_code: stop, oom: stop, numerical: stop, storage: stop, healthy: none}\n"
)


def _fleet_incident(nodes: list[str]) -> Incident:
    c = DomainCorrelator()
    fleet = FleetPolicy()
    c.observe("switch:leaf1", node_incident(nodes[0], 1.0, 1), fleet, nodes)
    found = c.observe("switch:leaf1", node_incident(nodes[1], 2.0, 2), fleet, nodes)
    assert found is not None
    return found


def test_fleet_drain_in_autonomy_is_one_drain_set_of_the_domains_other_nodes() -> None:
    policy = parse_policy("mode: autonomous\nfleet: {action: drain}\n" + POLICY)
    found = _fleet_incident(["gpu01", "gpu02", "gpu03", "gpu04"])
    decision, action = decide(policy, found, 10.0)
    assert decision.executed and decision.action == "drain" and "one drain set" in decision.rule
    assert action is not None and action.node is None and action.job_id is None
    # gpu01 and gpu02 failed: their own incidents drain them, for their own faults (whose way back
    # needs a health check); the set must not race them to it under the switch's name.
    assert action.nodes == ["gpu03", "gpu04"]
    # trainmedic's (the incident first) and left to a person (never the automatic way back).
    assert action.reason.startswith(f"trainmedic {found.incident_id}: ") and "| repair: switch:leaf1" in action.reason


def test_fleet_drain_in_monitor_mode_is_a_recommendation() -> None:
    policy = parse_policy("mode: monitor\nfleet: {action: drain}\n" + POLICY)
    decision, action = decide(policy, _fleet_incident(["gpu01", "gpu02", "gpu03"]), 10.0)
    assert action is None and not decision.executed and decision.action == "drain"
    assert "recommendation only" in decision.reason


def test_no_drain_set_when_every_node_of_the_domain_failed() -> None:
    policy = parse_policy("mode: autonomous\nfleet: {action: drain}\n" + POLICY)
    decision, action = decide(policy, _fleet_incident(["gpu01", "gpu02"]), 10.0)
    assert action is None and decision.action == "none" and "no drain set" in decision.reason


def test_drain_set_is_judged_as_a_whole_by_the_guardrails() -> None:
    sched = SimulatedScheduler(NODES)
    a = set_action(["gpu01", "gpu02", "gpu03"])
    # Three new drains against a cap of two: refused entirely, nothing drained.
    trip = rails(sched, max_drains_per_window=2, max_drain_fraction=1.0).check(a, 10.0)
    assert trip is not None and trip[0] == "blast_radius" and "refused as a whole" in trip[1]
    # The nodes already out (their own incidents drained them) do not count again.
    sched.drain_node("gpu01", "trainmedic inc-a: interconnect")
    sched.drain_node("gpu02", "trainmedic inc-b: interconnect")
    assert rails(sched, max_drains_per_window=2, max_drain_fraction=1.0).check(a, 10.0) is None
    # The blast radius: 3 of 10 nodes of the partition out, over 25 %.
    trip = rails(sched, max_drains_per_window=10, max_drain_fraction=0.25).check(a, 10.0)
    assert trip is not None and trip[0] == "blast_radius" and "3 of 10" in trip[1]
    # A node the scheduler does not know: fail closed.
    trip = rails(sched, max_drains_per_window=10, max_drain_fraction=1.0).check(set_action(["gpu01", "gpu99"]), 10.0)
    assert trip is not None and "gpu99" in trip[1]


def test_drain_set_drains_what_is_left_and_counts_one_drain_per_node() -> None:
    sched = SimulatedScheduler(NODES)
    sched.drain_node("gpu01", "trainmedic inc-a: interconnect")
    sched.drain_node("gpu02", "admin: cable check")
    g = rails(sched, max_drains_per_window=3, max_drain_fraction=1.0)
    a = set_action(["gpu01", "gpu02", "gpu03", "gpu04"])
    calls: list[tuple[str | None, str]] = []

    def before(one: Action, call: AttemptCall) -> None:
        calls.append((one.node, call))
        g.count(
            ActionAttempt(
                event_id=f"att-{one.node}",
                event_time=10.0,
                action_id=one.action_id,
                incident_id=one.incident_id,
                node=one.node,
                action=one.action,
                call=call,
                executor="test",
            )
        )

    result = Executor(sched, ExecutorSettings(verify_timeout_s=2, poll_interval_s=0.01)).execute(a, before)
    assert result.status == "done", result.steps
    assert calls == [("gpu03", "drain"), ("gpu04", "drain")]
    assert sched.node_state("gpu02").reason == "admin: cable check"  # someone else's reason stays
    for node in ("gpu03", "gpu04"):
        assert a.incident_id in (sched.node_state(node).reason or "")
    # Each drain of the set counts against the window: two, not one (the cap here is 3).
    trip = g.check(set_action(["gpu05", "gpu06"], incident="inc-other"), 11.0)
    assert trip is not None and trip[0] == "blast_radius" and "after 2 drain(s)" in trip[1]
    assert g.check(set_action(["gpu05"], incident="inc-other"), 11.0) is None


def test_scontrol_show_topology_reads_as_topology_conf() -> None:
    # As Slurm 22.05 and 24.11 print it for TOPOLOGY above: the spine lists every node below it.
    shown = (
        "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=gpu[01-02]\n"
        "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=gpu[03-04]\n"
        "SwitchName=spine Level=1 LinkSpeed=1 Nodes=gpu[01-04] Switches=leaf[1-2]\n"
    )
    assert parse_topology_conf(shown) == parse_topology_conf(TOPOLOGY)


def test_a_fleet_incident_naming_no_failed_nodes_gets_no_drain_set() -> None:
    policy = parse_policy("mode: autonomous\nfleet: {action: drain}\n" + POLICY)
    found = _fleet_incident(["gpu01", "gpu02", "gpu03"]).model_copy(update={"domain_failed_nodes": []})
    decision, action = decide(policy, found, 10.0)
    assert action is None and decision.action == "none" and "names no failed nodes" in decision.reason


def test_a_drain_set_acts_only_where_every_named_partition_is_autonomous() -> None:
    # The set may hold nodes of any partition: one in monitor mode for the category holds it back.
    text = "mode: autonomous\nfleet: {action: drain}\npartitions: {debug: {categories: {interconnect: monitor}}}\n"
    decision, action = decide(parse_policy(text + POLICY), _fleet_incident(["gpu01", "gpu02", "gpu03"]), 10.0)
    assert action is None and not decision.executed and decision.action == "drain"
    assert "monitor mode for debug" in decision.reason


def test_a_drain_set_with_a_node_outside_the_autonomy_partitions_is_refused() -> None:
    sched = SimulatedScheduler(NODES[:5], partition="train")
    sched._nodes["gpu03"].partition = "debug"
    g = rails(sched, max_drains_per_window=10, max_drain_fraction=1.0, autonomy_partitions=["train"])
    trip = g.check(set_action(["gpu03", "gpu04"]).model_copy(update={"partition": "train"}), 10.0)
    assert trip is not None and trip[0] == "partition_not_allowed" and "debug" in trip[1]
    assert g.check(set_action(["gpu04", "gpu05"]).model_copy(update={"partition": "train"}), 10.0) is None
