"""Per-job settings (issue #20 item 7): what a job's comment or an operator's job rule asks of
trainmedic, how the strictest wins, and what `decide` leaves of an action under them."""

from __future__ import annotations

import pytest

from schemas.events import Evidence, Incident
from schemas.job_settings import JobSettingError, from_comment, merge, parse_value
from schemas.vocab import Category
from sinks.executor import _marked_restarts, annotated
from streams.policy import Policy, PolicyError, decide, explain, parse_policy

ACTIONS = (
    "actions:\n  gpu_hardware: drain_and_requeue\n  node: drain_and_requeue\n  interconnect: requeue\n"
    "  hang: requeue\n  user_code: stop\n  oom: stop\n  numerical: stop\n  storage: stop\n  healthy: none\n"
)


def policy(extra: str = "") -> Policy:
    return parse_policy("mode: autonomous\n" + ACTIONS + extra)


def incident(
    comment: str | None,
    category: Category = "gpu_hardware",
    isolate: bool = True,
    restarts: int | None = 0,
    job_name: str | None = "train",
) -> Incident:
    return Incident(
        event_id="inc-1",
        incident_id="inc-1",
        event_time=10.0,
        job_id="100",
        partition="gpu",
        job_name=job_name,
        user="alice",
        account="ml",
        job_restarts=restarts,
        job_comment=comment,
        category=category,
        severity="critical",
        culprit_node="gpu02",
        confidence=0.95,
        isolate=isolate,
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=9.0,  # type: ignore[arg-type]
        evidence=[Evidence(source="kernel", signature="xid_79", node="gpu02", time=9.0, line="l", role="root")],
    )


@pytest.mark.parametrize(
    ("comment", "mode", "restarts"),
    [
        ("trainmedic=off", "off", None),
        ("exp42 trainmedic=monitor owner=alice", "monitor", None),
        ("trainmedic=restarts=2", None, 2),
        ("trainmedic=monitor,restarts=0", "monitor", 0),
        # Two tokens: the strictest of each.
        ("trainmedic=restarts=5 trainmedic=off,restarts=3", "off", 3),
        # The executor's mark is no setting.
        ("trainmedic act-1234 restarts=7", None, None),
        ("nottrainmedic=off", None, None),
        (None, None, None),
    ],
)
def test_comment_settings_merge_strictest(comment: str | None, mode: str | None, restarts: int | None) -> None:
    eff = merge(from_comment(comment))
    assert (eff.mode, eff.max_restarts) == (mode, restarts)


@pytest.mark.parametrize("value", ["banana", "", "restarts=-1", "restarts=two", "off,monitor", "off,,restarts=1"])
def test_unreadable_values_are_refused_naming_the_value(value: str) -> None:
    with pytest.raises(JobSettingError, match="trainmedic="):
        parse_value(value, "the job's comment")


def test_off_leaves_the_job_alone_but_still_drains_a_node_whose_own_fault_it_is() -> None:
    d, a = decide(policy(), incident("trainmedic=off"), 11.0)
    assert a is not None and (a.action, a.node, d.action) == ("drain", "gpu02", "drain")
    assert "trainmedic=off by the job's comment" in d.rule and "job 100 is not requeued" in d.reason
    # Not the node's fault: nothing at all.
    d, a = decide(policy(), incident("trainmedic=off", category="hang", isolate=False), 11.0)
    assert a is None and d.action == "none" and "the job is not touched" in d.rule
    d, a = decide(policy(), incident("trainmedic=off", category="user_code", isolate=False), 11.0)
    assert a is None and d.action == "none"


def test_monitor_makes_job_actions_recommendations_and_drains_the_node_only() -> None:
    d, a = decide(policy(), incident("trainmedic=monitor", category="hang", isolate=False), 11.0)
    assert a is None and not d.executed and d.action == "requeue" and "recommendation only" in d.reason
    d, a = decide(policy(), incident("trainmedic=monitor"), 11.0)
    assert a is not None and a.action == "drain" and "requeue of job 100 recommended, not done" in d.reason


def test_an_unreadable_setting_fails_closed_to_recommendations() -> None:
    d, a = decide(policy(), incident("trainmedic=of", category="hang", isolate=False), 11.0)
    assert a is None and not d.executed and "unreadable" in d.reason and "'of'" in d.reason


def test_without_a_setting_the_policy_decides_as_before() -> None:
    d, a = decide(policy(), incident("exp42 some notes"), 11.0)
    assert a is not None and a.action == "drain_and_requeue"


def test_restart_limit_from_the_comment_and_its_cap() -> None:
    # restarts=1: the job was restarted once by Slurm, so the next restart is not made.
    d, a = decide(policy(), incident("trainmedic=restarts=1", category="hang", isolate=False, restarts=1), 11.0)
    assert a is not None and a.action == "stop" and "limit 1 set by the job's comment" in d.rule
    d, a = decide(policy(), incident("trainmedic=restarts=1", category="hang", isolate=False, restarts=0), 11.0)
    assert a is not None and a.action == "requeue"
    # A user's limit above the policy's budget (3) is capped by it.
    d, a = decide(policy(), incident("trainmedic=restarts=50", category="hang", isolate=False, restarts=3), 11.0)
    assert a is not None and a.action == "stop" and "capped by the policy's restart budget (3)" in d.reason


def test_job_rules_by_name_and_the_comment_combine_strictest() -> None:
    pol = policy("job_settings:\n  rules:\n    - name: debug\n      match: {job_name: 'debug-*'}\n      set: monitor\n")
    d, a = decide(pol, incident(None, category="hang", isolate=False, job_name="debug-7"), 11.0)
    assert a is None and "job_settings.rules.debug" in d.reason
    d, a = decide(pol, incident(None, category="hang", isolate=False, job_name="train"), 11.0)
    assert a is not None
    # The comment cannot loosen the rule; off is stricter than the rule's monitor.
    d, a = decide(pol, incident("trainmedic=off", category="hang", isolate=False, job_name="debug-7"), 11.0)
    assert d.action == "none" and "trainmedic=off by the job's comment" in d.rule


def test_comments_ignored_when_the_policy_says_so() -> None:
    d, a = decide(policy("job_settings: {from_comment: false}\n"), incident("trainmedic=off"), 11.0)
    assert a is not None and a.action == "drain_and_requeue"


def test_a_bad_job_rule_is_refused_at_load_naming_the_line_and_field() -> None:
    text = (
        "mode: monitor\n" + ACTIONS + "job_settings:\n  rules:\n    - name: x\n      match: {}\n      set: sometimes\n"
    )
    with pytest.raises(PolicyError, match=r"line \d+: field 'job_settings.rules.0.set'.*'sometimes'"):
        parse_policy(text)


def test_explain_names_the_setting_that_applied() -> None:
    lines = explain(policy(), incident("trainmedic=off,restarts=2"))
    line = next(x for x in lines if x.startswith("  job settings:"))
    assert "trainmedic=off (the job's comment)" in line and "restarts=2 (the job's comment)" in line


def test_the_executor_mark_keeps_the_owners_comment() -> None:
    first = annotated("exp42 trainmedic=restarts=2", "trainmedic act-aaa restarts=0")
    assert first == "exp42 trainmedic=restarts=2 | trainmedic act-aaa restarts=0"
    second = annotated(first, "trainmedic act-bbb restarts=1")
    assert second == "exp42 trainmedic=restarts=2 | trainmedic act-bbb restarts=1"
    assert _marked_restarts(second, "act-bbb") == 1 and _marked_restarts(second, "act-aaa") is None
    assert merge(from_comment(second)).max_restarts == 2
    assert annotated(None, "trainmedic act-c restarts=0") == "trainmedic act-c restarts=0"
    assert annotated("a\nb", "trainmedic act-c restarts=0") == "a b | trainmedic act-c restarts=0"


@pytest.mark.parametrize(
    "comment", ["exp42,trainmedic=off", "Trainmedic=off", "trainmedic = off", "x;trainmedic=off", "trainmedic:off"]
)
def test_a_near_miss_is_an_error_so_the_job_is_recommend_only(comment: str) -> None:
    with pytest.raises(JobSettingError, match="is not a setting"):
        from_comment(comment)
    d, a = decide(policy(), incident(comment, category="hang", isolate=False), 11.0)
    assert a is None and not d.executed and "unreadable" in d.reason
    assert from_comment("nottrainmedic=off") == []  # another word


def test_a_spent_budget_stops_the_job_and_still_drains_the_faulty_node() -> None:
    spent = incident("trainmedic=restarts=0")
    d, a = decide(policy(), spent, 11.0)
    assert a is not None and (a.action, a.node) == ("drain_and_stop", "gpu02")
    # With trainmedic=off the job is not stopped, and the node is still drained.
    d, a = decide(policy(), incident("trainmedic=off,restarts=0"), 11.0)
    assert a is not None and a.action == "drain" and "job 100 is not stopped" in d.reason


def test_the_executor_reads_the_comment_again_before_it_touches_the_job() -> None:
    import time

    from schemas.events import Action
    from sinks.backends.simulated import SimulatedScheduler
    from sinks.executor import Executor, ExecutorSettings

    sched = SimulatedScheduler(["gpu01", "gpu02", "gpu03"], requeue_delay_s=0.0)
    job = sched.submit("train", 2)
    sched.annotate_job(job, "exp42 trainmedic=off")  # set by its owner after the incident
    now = time.time()
    act = Action(
        event_id="act-1",
        event_time=now,
        action_id="act-1",
        decision_id="dec-1",
        incident_id="inc-1",
        job_id=job,
        action="requeue",
        reason="trainmedic inc-1: hang",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now,
    )
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(act, lambda a, c: None)
    assert result.status == "skipped" and "its comment says trainmedic=off" in (result.error or "")
    assert sched.job_state(job).restart_count == 0 and not [c for c in sched.calls if c.startswith("requeue")]
