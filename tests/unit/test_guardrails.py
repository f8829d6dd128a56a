from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from schemas.events import Action, ActionAttempt, AttemptCall
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorSettings, Refused
from sinks.guardrails import (
    GuardrailConfigError,
    GuardrailFile,
    Guardrails,
    GuardrailSettings,
    parse_guardrails,
    requeues_without_drain,
)
from sinks.lease import Fenced

NODES = [f"gpu{i:02d}" for i in range(1, 11)]


def action(
    node: str | None,
    job: str | None,
    kind: str = "drain_and_requeue",
    by: str = "policy",
    partition: str = "gpu",
    incident: str = "inc-1",
) -> Action:
    return Action(
        event_id=f"act-{incident}",
        event_time=1.0,
        action_id=f"act-{incident}",
        decision_id="dec-1",
        incident_id=incident,
        job_id=job,
        node=node,
        partition=partition,
        action=kind,  # type: ignore[arg-type]
        reason=f"trainmedic {incident}: gpu_hardware",
        requested_by=by,
        incident_time=1.0,
        first_signal_time=0.5,
    )


def attempt(a: Action, call: AttemptCall, at: float) -> ActionAttempt:
    return ActionAttempt(
        event_id=f"att-{a.action_id}-{call}-{at}",
        event_time=at,
        action_id=a.action_id,
        incident_id=a.incident_id,
        job_id=a.job_id,
        node=a.node,
        partition=a.partition,
        action=a.action,
        call=call,
        executor="test",
    )


def recording(calls: list[str]) -> Callable[[Action, AttemptCall], None]:
    """A before-call hook that notes each call it lets through."""

    def before(a: Action, call: AttemptCall) -> None:
        calls.append(call)

    return before


def rails(sched: SimulatedScheduler, **settings: object) -> Guardrails:
    s = GuardrailSettings.model_validate(settings)
    return Guardrails(lambda: s, sched)


def test_kill_switch_stops_everything() -> None:
    sched = SimulatedScheduler(NODES)
    trip = rails(sched, kill_switch=True).check(action("gpu01", None), 10.0)
    assert trip is not None and trip[0] == "kill_switch"


def test_blast_radius_counts_drains_in_window() -> None:
    sched = SimulatedScheduler(NODES)
    g = rails(sched, max_drains_per_window=1, drain_window_s=600, max_drain_fraction=1.0)
    first = action("gpu01", None, incident="inc-1")
    assert g.check(first, 10.0) is None
    g.count(attempt(first, "drain", 10.0))
    trip = g.check(action("gpu02", None, incident="inc-2"), 20.0)
    assert trip is not None and trip[0] == "blast_radius" and "gpu01" in trip[1]
    assert g.check(action("gpu02", None, incident="inc-2"), 700.0) is None  # window passed


def test_blast_radius_fraction_of_partition() -> None:
    sched = SimulatedScheduler(NODES)
    sched.drain_node("gpu01", "someone else")
    g = rails(sched, max_drains_per_window=10, max_drain_fraction=0.1)
    trip = g.check(action("gpu02", None), 10.0)
    assert trip is not None and trip[0] == "blast_radius" and "2 of 10" in trip[1]


def test_partition_allow_list_applies_to_policy_not_operators() -> None:
    sched = SimulatedScheduler(NODES)
    g = rails(sched, autonomy_partitions=["canary"])
    trip = g.check(action("gpu01", None, partition="gpu"), 1.0)
    assert trip is not None and trip[0] == "partition_not_allowed"
    assert g.check(action("gpu01", None, partition="gpu", by="operator:alice"), 1.0) is None
    assert g.check(action("gpu01", None, partition="canary"), 1.0) is None


def test_restarts_per_job_are_the_policys_budget_not_a_guardrail() -> None:
    # One restart budget (streams/policy.py restart_budget): the executor counts none per job.
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 1)
    for _ in range(5):
        sched.requeue_job(job, [])
        sched.tick()
    g = rails(sched)
    for i in range(5):
        a = action(None, job, kind="requeue", incident=f"inc-{i}")
        g.count(attempt(a, "requeue", 1.0 + i))
    assert g.check(action(None, job, kind="requeue", incident="inc-9"), 10.0) is None


@pytest.mark.parametrize(
    ("key", "value", "moved_to"),
    [
        ("max_restarts_per_job", 3, "restart_budget.max_restarts"),
        ("restart_window_s", 21600, "restart_budget.window_h"),
    ],
)
def test_a_file_still_setting_the_old_restart_budget_is_refused(
    tmp_path: Path, key: str, value: int, moved_to: str
) -> None:
    """Fail closed: a limit the file expects but the executor no longer enforces is an error, never ignored."""
    text = f"guardrails:\n  max_drains_per_window: 2\n  {key}: {value}\n"
    with pytest.raises(GuardrailConfigError) as err:
        parse_guardrails(text, "p.yaml")
    assert f"p.yaml: field 'guardrails.{key}'" in str(err.value) and moved_to in str(err.value)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(GuardrailConfigError, match=key):
        GuardrailFile(path)  # the executor does not start on it
    path.write_text("guardrails:\n  kill_switch: false\n")
    f = GuardrailFile(path)
    path.write_text(text.replace("max_drains_per_window: 2", "kill_switch: true"))
    import os

    os.utime(path, (5, 5))
    assert not f().kill_switch  # a reload that sets it is refused: the previous settings stay
    with pytest.raises(ValueError, match=f"{key} is no longer a guardrail.*{moved_to}"):
        GuardrailSettings.model_validate({key: value})


def test_node_cooldown() -> None:
    sched = SimulatedScheduler(NODES)
    g = rails(sched, node_cooldown_s=300, max_drains_per_window=10, max_drain_fraction=1.0)
    g.count(attempt(action("gpu03", None), "drain", 100.0))
    trip = g.check(action("gpu03", None, incident="inc-9"), 200.0)
    assert trip is not None and trip[0] == "node_cooldown"


def test_guardrail_file_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(GuardrailConfigError, match="guardrails.max_drains_per_window"):
        parse_guardrails("guardrails:\n  max_drains_per_window: -1\n", "p.yaml")
    path = tmp_path / "p.yaml"
    path.write_text("guardrails:\n  kill_switch: false\n")
    f = GuardrailFile(path)
    assert not f().kill_switch
    path.write_text("guardrails:\n  kill_switch: true\n")
    import os

    os.utime(path, (5, 5))
    assert f().kill_switch  # takes effect without a restart


def test_redelivered_action_is_not_performed_twice() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 4)
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    a = action("gpu02", job)
    calls: list[str] = []
    first = ex.execute(a, recording(calls))
    second = ex.execute(a, recording(calls))  # redelivered after a crash before the offset commit
    assert first.status == second.status == "done"
    assert calls == ["drain", "requeue"], "every call the scheduler saw went through the hook, once"
    assert sched.calls == ["drain gpu02", f"requeue {job} exclude=gpu02"]
    assert any("already" in step for step in second.steps)


def test_plain_requeue_recognised_from_the_job_mark() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 2)
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    a = action(None, job, kind="requeue")
    assert ex.execute(a, recording([])).status == "done"
    again = ex.execute(a, recording([]))
    assert again.status == "done" and sched.job_state(job).restart_count == 1
    assert "already done by this action" in " ".join(again.steps)


def test_node_drained_by_someone_else_is_left_alone() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 4)
    sched.drain_node("gpu02", "admin: bad fan")
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(
        action("gpu02", job), recording([])
    )
    assert result.status == "done" and sched.node_state("gpu02").reason == "admin: bad fan"


def test_crash_between_requeuehold_and_release_is_finished_on_redelivery() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 4)
    a = action("gpu02", job)
    # What a crash after "mark, requeue (held)" and before "exclude, release" leaves behind:
    sched.drain_node("gpu02", a.reason)
    sched.annotate_job(job, f"trainmedic {a.action_id} restarts=0")
    sched.hold_job(job)
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(a, recording([]))
    assert result.status == "done", result
    state = sched.job_state(job)
    assert state.state == "RUNNING" and "gpu02" not in state.nodes and state.restart_count == 1
    assert "released the hold" in " ".join(result.steps)


def test_stop_with_hold_keeps_the_job_held() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 2)
    a = action(None, job, kind="stop").model_copy(update={"stop_mode": "hold"})
    calls: list[str] = []
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(a, recording(calls))
    assert result.status == "done" and "held" in result.steps[-1] and calls == ["hold"]
    state = sched.job_state(job)
    assert state.state == "PENDING" and state.held


def test_restored_attempts_keep_the_blast_radius_and_cooldown_across_a_restart() -> None:
    sched = SimulatedScheduler(NODES)
    settings = {"max_drains_per_window": 1, "drain_window_s": 600, "max_drain_fraction": 1.0, "node_cooldown_s": 300}
    drained, requeued = action("gpu01", "7", incident="inc-1"), action(None, "8", kind="requeue", incident="inc-3")
    restarted = rails(sched, **settings)
    # Read back with duplicates (a redelivery records its calls again): one drain, one requeue count.
    records = [attempt(drained, "drain", 10.0), attempt(drained, "drain", 12.0), attempt(drained, "requeue", 10.5)]
    assert restarted.restore([*records, attempt(requeued, "requeue", 11.0)]) == 3
    trip = restarted.check(action("gpu02", None, incident="inc-2"), 20.0)
    assert trip is not None and trip[0] == "blast_radius" and "gpu01" in trip[1]
    trip = restarted.check(action("gpu01", None, incident="inc-9"), 100.0)
    assert trip is not None and trip[0] == "node_cooldown"
    # The redelivered action itself is not refused: its calls are counted, its steps recognise
    # what is done.
    assert restarted.check(drained, 20.0) is None
    assert restarted.check(action("gpu02", None, incident="inc-2"), 700.0) is None  # the window has passed


def test_an_attempt_counts_whatever_the_action_ended_with() -> None:
    """A drain whose requeue then failed is counted: counting happens at the call, not the result."""
    sched = SimulatedScheduler(NODES, requeue_delay_s=3600)  # the requeued job never runs again
    job = sched.submit("t", 2)
    g = rails(sched, max_drains_per_window=1, max_drain_fraction=1.0)
    a = action(sched.job_state(job).nodes[0], job, incident="inc-1")

    def count_it(act: Action, call: AttemptCall) -> None:
        g.count(attempt(act, call, 10.0))

    ex = Executor(sched, ExecutorSettings(verify_timeout_s=0.3, poll_interval_s=0.01))
    result = ex.execute(a, count_it)
    assert result.status == "failed" and "not verified" in (result.error or "")
    trip = g.check(action("gpu09", None, incident="inc-2"), 20.0)
    assert trip is not None and trip[0] == "blast_radius", trip


def test_a_call_the_hook_refuses_is_not_made() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 2)

    def fenced(act: Action, call: AttemptCall) -> None:
        raise Fenced("lost the lease")

    with pytest.raises(Fenced):
        Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(
            action(sched.job_state(job).nodes[0], job), fenced
        )
    assert sched.calls == []


def test_drain_refused_for_a_node_that_is_not_the_jobs() -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 4)  # gpu01-04
    other = sched.submit("other", 2)  # gpu05-06
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    calls: list[str] = []
    with pytest.raises(Refused) as refused:
        ex.execute(action("gpu06", job, incident="inc-foreign"), recording(calls))
    assert refused.value.guardrail == "culprit_not_in_job"
    assert "gpu06" in refused.value.detail and "gpu01,gpu02,gpu03,gpu04" in refused.value.detail
    assert calls == [] and sched.calls == [] and sched.job_state(other).state == "RUNNING"
    # The node's own kernel/GPU report is evidence enough, whoever runs there.
    own = action("gpu06", job, incident="inc-own").model_copy(update={"node_reported_fault": True})
    assert ex.execute(own, recording(calls)).status == "done" and sched.node_state("gpu06").drained


def test_drain_refused_when_the_jobs_nodes_cannot_be_read() -> None:
    sched = SimulatedScheduler(NODES)
    with pytest.raises(Refused, match="cannot be read"):
        Executor(sched, ExecutorSettings(verify_timeout_s=5)).execute(action("gpu01", "99999"), recording([]))
    assert sched.calls == []


def test_an_isolation_without_a_node_is_not_turned_into_a_plain_requeue() -> None:
    # An approved drain_and_requeue whose culprit is only a rank or GPU: requeueing it anyway
    # could land the job on the same bad GPU.
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 4)
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5)).execute(action(None, job), recording([]))
    assert result.status == "failed" and "needs the culprit's node" in (result.error or "")
    assert sched.calls == [] and sched.job_state(job).state == "RUNNING"


def test_a_drain_of_the_node_only_is_capped_like_any_drain() -> None:
    """`drain` (a job whose owner said trainmedic=off) takes a node out: the blast radius counts it."""
    sched = SimulatedScheduler(NODES)
    g = rails(sched, max_drains_per_window=1, drain_window_s=600, max_drain_fraction=1.0)
    first = action("gpu01", "7", kind="drain", incident="inc-1")
    assert g.check(first, 10.0) is None
    g.record(first, 10.0)
    trip = g.check(action("gpu02", "8", kind="drain", incident="inc-2"), 20.0)
    assert trip is not None and trip[0] == "blast_radius" and "gpu01" in trip[1]


def test_the_kill_switch_is_read_from_a_policy_file_whose_other_sections_are_invalid(tmp_path: Path) -> None:
    """The brake: an operator who sets the kill switch in a file that policy validation refuses
    (an unknown category) still stops every scheduler action; the executor reads only its section."""
    from streams.policy import DEFAULT_POLICY, PolicyError, load_policy

    path = tmp_path / "policy.yaml"
    path.write_text(DEFAULT_POLICY.read_text())
    f = GuardrailFile(path)
    assert not f().kill_switch
    broken = DEFAULT_POLICY.read_text().replace("\nactions:\n", "\nactions:\n  gpu_hardwre: stop\n", 1)
    path.write_text(broken.replace("kill_switch: false", "kill_switch: true"))
    import os

    os.utime(path, (5, 5))
    with pytest.raises(PolicyError, match="unknown category"):
        load_policy(path)
    assert f().kill_switch
    trip = Guardrails(f, SimulatedScheduler(NODES)).check(action("gpu01", None), 10.0)
    assert trip is not None and trip[0] == "kill_switch"


@pytest.mark.parametrize(
    ("guardrail", "kind", "job", "node", "goes_on"),
    [
        ("blast_radius", "drain_and_requeue", "7", "gpu01", True),
        ("node_cooldown", "drain_and_requeue", "7", "gpu01", True),
        # The kill switch and the autonomy allow-list refuse the whole action, as does a node that is not the job's.
        ("kill_switch", "drain_and_requeue", "7", "gpu01", False),
        ("partition_not_allowed", "drain_and_requeue", "7", "gpu01", False),
        ("culprit_not_in_job", "drain_and_requeue", "7", "gpu01", False),
        # Nothing to requeue: a drain alone (the owner said hands off the job), no job, no node to exclude.
        ("blast_radius", "drain", "7", "gpu01", False),
        ("blast_radius", "drain_and_requeue", None, "gpu01", False),
        ("blast_radius", "drain_and_requeue", "7", None, False),
        # The budget is spent (policy sent drain_and_stop): no restart to fall back to.
        ("blast_radius", "drain_and_stop", "7", "gpu01", False),
    ],
)
def test_only_a_cap_on_drains_leaves_the_requeue_to_do(
    guardrail: str, kind: str, job: str | None, node: str | None, goes_on: bool
) -> None:
    trip = (guardrail, "why")
    assert requeues_without_drain(action(node, job, kind=kind), trip) is goes_on  # type: ignore[arg-type]


def test_a_drain_refused_by_the_cooldown_still_requeues_the_job_excluding_the_node() -> None:
    """Issue 40: the cap keeps the node in service, not the job on it (its GPU fell off the bus)."""
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.0)
    job = sched.submit("t", 4)  # gpu01-04
    g = rails(sched, node_cooldown_s=600, max_drains_per_window=10, max_drain_fraction=1.0)
    g.count(attempt(action("gpu02", "7", incident="inc-0"), "drain", 100.0))  # acted on, since resumed
    a = action("gpu02", job).model_copy(update={"remediation": "reboot", "remediation_bucket": "RESET_GPU"})
    trip = g.check(a, 200.0)
    assert trip is not None and trip[0] == "node_cooldown" and requeues_without_drain(a, trip)
    calls: list[str] = []
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(
        a, recording(calls), drain_refused=trip
    )
    assert result.status == "done" and result.verified_at is not None, result
    assert calls == ["requeue"] and sched.calls == [f"requeue {job} exclude=gpu02"], "no drain, no reboot"
    assert not sched.node_state("gpu02").drained
    state = sched.job_state(job)
    assert state.state == "RUNNING" and "gpu02" in state.excluded_nodes and "gpu02" not in state.nodes
    assert result.steps[0].startswith("drain gpu02: refused by guardrail node_cooldown (gpu02 was acted on 100 s ago")
    assert f"job {job} is requeued with it excluded" in result.steps[0]
    assert any(step.startswith(f"requeue {job}: verified requeued") for step in result.steps)


def test_a_refused_drain_is_never_passed_for_an_action_that_cannot_go_on_without_it() -> None:
    sched = SimulatedScheduler(NODES)
    with pytest.raises(ValueError, match="nothing to do for drain_and_stop"):
        Executor(sched).execute(action("gpu01", "7", kind="drain_and_stop"), recording([]), ("blast_radius", "x"))
    assert sched.calls == []


def test_a_redelivered_requeue_whose_drain_was_refused_is_not_drained_then() -> None:
    """A redelivery (crash after the requeue, before the result) is let through as already counted,
    but its drain was never attempted: the caps judge the drain again, so it is not slipped in."""
    sched = SimulatedScheduler(NODES)
    settings = [GuardrailSettings(max_drains_per_window=1, drain_window_s=600, max_drain_fraction=1.0)]
    g = Guardrails(lambda: settings[-1], sched)
    g.count(attempt(action("gpu01", "7", incident="inc-1"), "drain", 10.0))
    capped = action("gpu02", "8", incident="inc-2")
    trip = g.check(capped, 20.0)
    assert trip is not None and trip[0] == "blast_radius"
    g.count(attempt(capped, "requeue", 21.0))  # the requeue without the drain, then a crash
    again = g.check(capped, 30.0)
    assert again is not None and again[0] == "blast_radius" and requeues_without_drain(capped, again)
    assert g.check(capped, 700.0) is None, "the window has passed: the drain may be made now"
    # An action whose drain was attempted is finished whatever the caps say now.
    drained = action("gpu03", "9", incident="inc-3")
    g.count(attempt(drained, "drain", 40.0))
    g.count(attempt(drained, "requeue", 41.0))
    assert g.check(drained, 50.0) is None
    # The kill switch still refuses the whole of it.
    settings.append(settings[0].model_copy(update={"kill_switch": True}))
    braked = g.check(capped, 30.0)
    assert braked is not None and braked[0] == "kill_switch" and not requeues_without_drain(capped, braked)
