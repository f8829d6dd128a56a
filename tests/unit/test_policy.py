from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas.events import Evidence, Incident
from schemas.vocab import Category
from streams.policy import PolicyError, choose_action, decide, explain, load_policy, parse_policy
from streams.policy_store import PolicyStore


def incident(
    category: Category = "gpu_hardware",
    culprit: str | None = "gpu02",
    isolate: bool = True,
    confidence: float = 0.95,
    job: str | None = "100",
    partition: str = "gpu",
) -> Incident:
    return Incident(
        event_id="inc-1",
        incident_id="inc-1",
        event_time=10.0,
        job_id=job,
        partition=partition,
        category=category,
        severity="critical",
        culprit_node=culprit,
        confidence=confidence,
        isolate=isolate,
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=9.0,  # type: ignore[arg-type]
        evidence=[Evidence(source="kernel", signature="xid_79", node=culprit, time=9.0, line="l", role="root")],
    )


def test_default_policy_is_monitor_mode() -> None:
    policy = load_policy()
    assert policy.mode == "monitor"
    decision, action = decide(policy, incident(), 11.0)
    assert action is None and not decision.executed and decision.action == "drain_and_requeue"
    assert "recommendation only" in decision.reason


def test_autonomous_partition_acts_with_stable_action_id() -> None:
    policy = parse_policy("mode: monitor\npartitions: {gpu: {mode: autonomous}}\n" + _actions())
    d1, a1 = decide(policy, incident(), 11.0)
    d2, a2 = decide(policy, incident(), 99.0)
    assert d1.executed and a1 is not None and a2 is not None and a1.action_id == a2.action_id
    assert (a1.action, a1.node, a1.job_id) == ("drain_and_requeue", "gpu02", "100")
    assert "inc-1" in a1.reason
    _, other = decide(policy, incident(partition="batch"), 11.0)
    assert other is None


def test_the_fault_not_the_category_says_whether_a_restart_isolates() -> None:
    """The action is chosen once, by policy: from the category's action and the fault's `isolate`."""
    policy = load_policy()
    # NVIDIA's RESTART_APP Xids (isolate: false): the GPU is fine, the application restarts.
    restart_app = incident(category="gpu_hardware", isolate=False)
    assert choose_action(policy, restart_app) == (
        "requeue",
        "actions.gpu_hardware=drain_and_requeue (not a fault of the node: requeue)",
    )
    d, _ = decide(policy.with_mode("autonomous"), restart_app, 11.0)
    assert d.action == "requeue" and "not a fault of the node" in d.rule
    # The node's own InfiniBand port going down (ib_port_error, isolate: true): the node leaves.
    port = incident(category="interconnect", isolate=True)
    assert choose_action(policy, port) == (
        "drain_and_requeue",
        "actions.interconnect=requeue (fault of the node: isolate)",
    )
    assert choose_action(policy, incident(category="interconnect", isolate=False))[0] == "requeue"
    # Neither a stop nor "none" is turned into a restart by the fault's place.
    assert choose_action(policy, incident(category="oom", isolate=True)) == ("stop", "actions.oom=stop")
    assert choose_action(policy, incident(category="unknown", isolate=True))[0] == "none"
    # A rule is an operator's explicit choice: taken as written.
    ruled = parse_policy("mode: autonomous\nrules:\n  - {name: never-drain, action: requeue}\n" + _actions())
    d, a = decide(ruled, incident(isolate=True), 11.0)
    assert d.rule == "rules.never-drain=requeue" and a is not None and a.action == "requeue"
    lines = explain(policy, restart_app)
    assert "fault of the node: no" in lines[0] and any(ln.startswith("  facts call for: requeue") for ln in lines)


def test_unresolved_culprit_stays_a_drain_recommendation_naming_rank_and_gpu() -> None:
    """Never a silent plain requeue: it may land on the same bad GPU."""
    policy = parse_policy("mode: autonomous\n" + _actions())
    inc = incident(category="gpu_hardware", culprit=None).model_copy(update={"culprit_rank": 5, "culprit_gpu": 1})
    d, a = decide(policy, inc, 11.0)
    assert a is None and not d.executed and d.action == "drain_and_requeue"
    assert (d.culprit_rank, d.culprit_gpu) == (5, 1)
    assert "rank 5 GPU 1" in d.reason and "recommendation only" in d.reason and "not resolved" in d.rule


def test_log_named_node_outside_the_job_gets_no_action() -> None:
    """Issue 14: a job on gpu01-04 printing 'srun: error: Node failure on gpu06' drains nothing."""
    policy = parse_policy("mode: autonomous\n" + _actions())
    inc = incident(category="node", culprit="gpu06").model_copy(
        update={
            "job_nodes": ["gpu01", "gpu02", "gpu03", "gpu04"],
            "culprit_in_job": False,
            "evidence": [
                Evidence(source="job_log", signature="srun_node_failure", node="gpu06", time=9.0, line="l", role="root")
            ],
        }
    )
    d, a = decide(policy, inc, 11.0)
    assert a is None and d.action == "none" and not d.executed
    assert "gpu06" in d.reason and "not one of the job's nodes" in d.reason and "gpu01" in d.reason


def test_log_named_node_of_the_job_restarts_the_job_and_isolates_nothing() -> None:
    """Issue 41: the job's own output naming one of its nodes (per the scheduler) used to drain that
    node. Now job evidence restarts only the job; isolating the node is a recommendation for a person."""
    policy = parse_policy("mode: autonomous\n" + _actions())
    log_evidence = [
        Evidence(source="job_log", signature="srun_node_failure", node="gpu02", time=9.0, line="l", role="root")
    ]
    assert log_evidence[0].provenance == "job"
    inc = incident(category="node").model_copy(update={"culprit_in_job": True, "evidence": log_evidence})
    d, a = decide(policy, inc, 11.0)
    assert a is not None and (a.action, a.node) == ("requeue", "gpu02")
    assert d.action == "requeue" and d.executed
    assert "job evidence only" in d.rule and "isolating gpu02 is for a person" in d.rule
    assert "never isolates a node on its own" in d.reason and "isolating gpu02 recommended" in d.reason
    # The same line without the scheduler's placement: a recommendation, not an action.
    d, a = decide(policy, inc.model_copy(update={"culprit_in_job": None}), 11.0)
    assert a is None and d.action == "drain_and_requeue" and "placement of the job is unknown" in d.reason


def test_kernel_evidence_from_the_culprit_node_counts_as_that_node() -> None:
    policy = parse_policy("mode: autonomous\n" + _actions())
    d, a = decide(policy, incident(), 11.0)  # xid_79 from gpu02's own kernel log, placement unknown
    assert a is not None and a.node == "gpu02" and a.node_reported_fault


def test_unknown_never_acts() -> None:
    policy = parse_policy("mode: autonomous\nrules:\n  - {name: all, action: requeue}\n" + _actions())
    d, a = decide(policy, incident(category="unknown", culprit=None, isolate=False), 11.0)
    assert a is None and d.action == "none" and "unknown never acts" in d.rule


def test_policy_without_unknown_gets_none() -> None:
    assert parse_policy("mode: monitor\n" + _actions()).actions["unknown"] == "none"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("  unknown: requeue\n", "field 'actions.unknown': must be none (got requeue)"),
        (
            "rules:\n  - {name: r, match: {category: [unknown]}, action: stop}\n",
            "field 'rules.0.match.category': rule 'r' maps unknown to stop",
        ),
    ],
)
def test_policy_refuses_acting_on_unknown(extra: str, needle: str) -> None:
    text = "mode: monitor\n" + _actions() + extra if extra.startswith("  ") else "mode: monitor\n" + extra + _actions()
    with pytest.raises(PolicyError, match="needs a person") as err:
        parse_policy(text, "p.yaml")
    assert needle in str(err.value) and str(err.value).startswith("p.yaml: line ")


def test_low_confidence_only_recommends() -> None:
    policy = parse_policy("mode: autonomous\n" + _actions())
    d, a = decide(policy, incident(confidence=0.4), 11.0)
    assert a is None and "min_confidence" in d.reason


def _actions() -> str:
    return (
        "actions:\n  gpu_hardware: drain_and_requeue\n  node: drain_and_requeue\n  interconnect: requeue\n"
        "  hang: requeue\n  user_code: stop\n  oom: stop\n  numerical: stop\n  storage: stop\n  healthy: none\n"
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("mode: sometimes\n" + _actions(), "line 1: field 'mode'"),
        ("mode: monitor\nactions:\n  gpu_hardware: reboot\n", "line 3: field 'actions.gpu_hardware'"),
        ("mode: monitor\nactions:\n  gpu_hardwre: stop\n", "line 3: field 'actions.gpu_hardwre'"),
        ("mode: monitor\nactions:\n  gpu_hardware: stop\n", "no action for"),
        ("mode: [\n", "not valid YAML"),
    ],
)
def test_invalid_policy_names_line_and_field(text: str, needle: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(text, "p.yaml")
    assert needle in str(err.value) and str(err.value).startswith("p.yaml")


def test_store_reloads_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("mode: monitor\n" + _actions())
    store = PolicyStore(path)
    assert store.policy.mode == "monitor"
    path.write_text("mode: autonomous\n" + _actions())
    import os

    os.utime(path, (1, 1))
    assert store.policy.mode == "autonomous"
    path.write_text("mode: bogus\n")
    os.utime(path, (2, 2))
    assert store.policy.mode == "autonomous"


RULES = """
rules:
  - name: canary-hardware-only-if-sure
    match: {category: [gpu_hardware], partition: "canary*", min_confidence: 0.9}
    action: drain_and_requeue
  - name: canary-hardware-unsure
    match: {category: [gpu_hardware], partition: "canary*"}
    action: none
  - name: user-bugs-hold
    match: {category: [user_code, oom, numerical], min_severity: error}
    action: stop
    stop: hold
"""


def test_rules_first_match_wins_then_actions() -> None:
    policy = parse_policy("mode: autonomous\n" + _actions() + RULES)
    d, a = decide(policy, incident(partition="canary-a", confidence=0.95), 11.0)
    assert d.rule == "rules.canary-hardware-only-if-sure=drain_and_requeue" and a is not None
    d, a = decide(policy, incident(partition="canary-a", confidence=0.7), 11.0)
    assert d.rule == "rules.canary-hardware-unsure=none" and d.action == "none" and a is None
    d, a = decide(policy, incident(partition="gpu"), 11.0)
    assert d.rule == "actions.gpu_hardware=drain_and_requeue" and a is not None
    d, a = decide(policy, incident(category="user_code", isolate=False, culprit=None), 11.0)
    assert d.rule == "rules.user-bugs-hold=stop" and a is not None and a.stop_mode == "hold"


def test_restart_budget_exhaustion_turns_restarts_into_stop(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("mode: autonomous\nrestart_budget: {max_restarts: 2, window_h: 6}\n" + _actions())
    store = PolicyStore(path)
    actions = []
    for i in range(4):
        inc = incident().model_copy(update={"incident_id": f"inc-{i}", "event_id": f"inc-{i}"})
        _, a = store.decide(inc, now=100.0 + i)
        assert a is not None
        actions.append((a.action, a.stop_mode))
    assert actions == [
        ("drain_and_requeue", "cancel"),
        ("drain_and_requeue", "cancel"),
        # The budget stops the job; the node's own fault (Xid 79 in its kernel log) still drains it.
        ("drain_and_stop", "hold"),
        ("drain_and_stop", "hold"),
    ]
    _, a = store.decide(incident().model_copy(update={"incident_id": "inc-late"}), now=100.0 + 7 * 3600)
    assert a is not None and a.action == "drain_and_requeue"  # the window has passed


def test_invalid_rule_names_its_line() -> None:
    bad = (
        "mode: monitor\n" + _actions() + "rules:\n  - name: x\n    match: {category: [gpu_hardwre]}\n    action: stop\n"
    )
    with pytest.raises(PolicyError, match=r"line 14: field 'rules.0.match.category.0'"):
        parse_policy(bad, "p.yaml")


def test_a_worker_restart_keeps_the_restart_budget_it_recovers_from_its_table(tmp_path: Path) -> None:
    """A worker restart (or the partition moving to another worker) must not hand a crash-looping
    job a fresh restart budget: the budget lives in a table the next worker recovers."""
    path = tmp_path / "p.yaml"
    path.write_text("mode: autonomous\nrestart_budget: {max_restarts: 2, window_h: 6}\n" + _actions())
    table: dict[str, Any] = {}  # what the Faust table's changelog gives the next worker back
    first = PolicyStore(path, restarts=table)
    for i in range(2):
        _, a = first.decide(incident().model_copy(update={"incident_id": f"inc-{i}"}), now=100.0 + i)
        assert a is not None
    restarted = PolicyStore(path, restarts=dict(table))
    _, a = restarted.decide(incident().model_copy(update={"incident_id": "inc-2"}), now=110.0)
    assert a is not None and (a.action, a.stop_mode) == ("drain_and_stop", "hold")
    # Outside the window the budget is whole again, and the table forgets what it no longer needs.
    later = PolicyStore(path, restarts=table)
    _, a = later.decide(incident().model_copy(update={"incident_id": "inc-3"}), now=100.0 + 7 * 3600)
    assert a is not None and a.action == "drain_and_requeue"
    assert [e[0] for e in table["100"]] == [a.action_id]


OWNER_RULES = """
rules:
  - name: research-sweeps-only-recommend
    match: {account: "research-*", job_name: "sweep-*"}
    action: none
  - name: alice-holds
    match: {user: alice, category: [gpu_hardware]}
    action: stop
    stop: hold
"""


def test_rules_match_job_name_user_and_account_globs() -> None:
    policy = parse_policy("mode: autonomous\n" + _actions() + OWNER_RULES)

    def owned(**owner: str) -> Incident:
        return incident().model_copy(update=owner)

    d, _ = decide(policy, owned(account="research-nlp", job_name="sweep-17", user="bob"), 11.0)
    assert d.rule == "rules.research-sweeps-only-recommend=none"
    d, _ = decide(policy, owned(account="research-nlp", job_name="pretrain-70b", user="bob"), 11.0)
    assert d.rule == "actions.gpu_hardware=drain_and_requeue"  # both globs must hold
    d, a = decide(policy, owned(user="alice"), 11.0)
    assert d.rule == "rules.alice-holds=stop" and a is not None and a.stop_mode == "hold"
    # No scheduler state seen for the job: an owner rule cannot vouch for it.
    d, _ = decide(policy, incident(), 11.0)
    assert d.rule == "actions.gpu_hardware=drain_and_requeue"
    assert "name - user alice account -" in "\n".join(explain(policy, owned(user="alice")))


def test_an_ingested_health_event_is_not_the_nodes_own_report() -> None:
    # The ingest endpoint takes the node from the request under one shared token (NVRx runs in
    # jobs): such evidence needs the scheduler's placement like a job's output.
    policy = parse_policy("mode: autonomous\n" + _actions())
    ext = [Evidence(source="external", signature="nvsentinel_fatal", node="gpu02", time=9.0, line="l", role="root")]
    d, a = decide(policy, incident().model_copy(update={"evidence": ext}), 11.0)
    assert a is None and "placement of the job is unknown" in d.reason


def test_slurms_restart_count_counts_toward_the_one_budget() -> None:
    # Restarts nobody here remembers (an operator's approvals, a worker before a broker restart):
    # the scheduler's count of them still spends the job's budget.
    policy = parse_policy("mode: autonomous\nrestart_budget: {max_restarts: 2, window_h: 6}\n" + _actions())
    fresh = incident().model_copy(update={"job_restarts": 1})
    d, a = decide(policy, fresh, 11.0)
    assert a is not None and a.action == "drain_and_requeue"
    spent = incident().model_copy(update={"job_restarts": 2})
    d, a = decide(policy, spent, 11.0)
    assert a is not None and a.action == "drain_and_stop"
    # A fault that is not the node's: the job is stopped and no node is drained.
    d, a = decide(policy, spent.model_copy(update={"category": "hang", "isolate": False}), 11.0)
    assert a is not None and a.action == "stop"
    assert "Slurm restarted the job 2 times" in d.rule


def test_a_restart_is_counted_once_however_often_its_incident_or_action_comes_back(tmp_path: Path) -> None:
    """Partitions moving between workers read the actions back again, and an incident may be
    delivered twice: neither may spend the job's budget twice."""
    path = tmp_path / "p.yaml"
    path.write_text("mode: autonomous\nrestart_budget: {max_restarts: 2, window_h: 6}\n" + _actions())
    store = PolicyStore(path)
    first = incident().model_copy(update={"incident_id": "inc-0"})
    _, a = store.decide(first, now=100.0)
    assert a is not None
    _, again = store.decide(first, now=101.0)  # the same incident redelivered
    assert again is not None and again.action_id == a.action_id
    assert store.restarts.count("100", a.action_id, 105.0) is False  # the same action again counts nothing
    assert store.restore([a, a]) == 0  # read back on a take-over over what the table holds: nothing new
    _, b = store.decide(incident().model_copy(update={"incident_id": "inc-1"}), now=110.0)
    assert b is not None and b.action == a.action  # the second restart of two is still allowed
    _, c = store.decide(incident().model_copy(update={"incident_id": "inc-2"}), now=120.0)
    assert c is not None and (c.action, c.stop_mode) == ("drain_and_stop", "hold")
