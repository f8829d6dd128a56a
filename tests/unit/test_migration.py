"""Checkpoint-aligned migration as pure logic (streams/migration.py, streams/policy.py
decide_predicted) and the predictive-drain cap (sinks/guardrails.py). Verdicts come from the real
pre-failure detector reading samples of the real NVML collector over the fake pynvml module; the
progress samples from the real progress parser reading framework lines."""

from __future__ import annotations

from typing import Any

import pytest

from producers.gpu_nvml import NvmlCollector
from producers.progress import ProgressParser
from schemas.events import Action, ActionAttempt, GpuSample, Incident, ProgressBatch
from schemas.ids import stable_id
from schemas.job_settings import JobSettingError, checkpoint_signal, parse_value
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorSettings
from sinks.guardrails import Guardrails, GuardrailSettings
from streams.detectors.prefailure import PreFailureDetector, PreFailureVerdict
from streams.lineage import Lineages
from streams.migration import MigrationBook, absorbed_decision, answered_by, predicted_incident, requeue_action
from streams.placement import Placement
from streams.policy import decide, decide_predicted, load_policy
from tests.fakes.fake_pynvml import FakeNvml

NODE = "gpu03"
T0 = 1_800_000_000.0
PLACEMENT = Placement(job_id="4242", nodes=("gpu02", NODE), partition="gpu", since=T0 - 600, event_id="sched-1")


def verdict_of(detector: PreFailureDetector | None = None, gpu: int = 2) -> PreFailureVerdict:
    """The verdict the detector raises when the fake GPU reports a row remap pending."""
    fake = FakeNvml()
    collector = NvmlCollector(fake)
    detector = detector or PreFailureDetector()

    def sample(t: float) -> GpuSample:
        s = collector.sample(NODE)
        return s.model_copy(update={"event_time": t, "event_id": stable_id("gpu", NODE, f"{t:.3f}")})

    assert detector.observe(sample(T0)) == []
    fake.gpus[gpu].remapped_rows = (0, 1, 1, 0)
    (verdict,) = detector.observe(sample(T0 + 10))
    return verdict


def policy(**prediction: Any) -> Any:
    base = load_policy()
    update: dict[str, Any] = {"mode": "autonomous"}
    if prediction:
        update["prediction"] = base.prediction.model_copy(update=prediction)
    return base.model_copy(update=update)


def progress(lines: list[str], t: float) -> ProgressBatch:
    parser = ProgressParser()
    samples = [s for i, line in enumerate(lines) if (s := parser.parse(line, t + i, 0, NODE)) is not None]
    assert samples, lines
    return ProgressBatch(event_id=f"prog-{t}", event_time=t, job_id=PLACEMENT.job_id, samples=samples)


def test_a_verdict_is_a_predicted_incident_on_the_gpus_own_evidence() -> None:
    verdict = verdict_of()
    incident = predicted_incident(verdict, PLACEMENT, T0 + 11)
    assert (incident.kind, incident.job_id, incident.culprit_node, incident.culprit_gpu) == (
        "predicted",
        "4242",
        NODE,
        2,
    )
    assert incident.isolate and incident.isolatable and incident.provenance == "gpu"
    assert [e.signature for e in incident.evidence] == ["prefailure_row_remap_pending"]
    assert "a GPU reset is required" in incident.explanation
    # A restarted worker reading the same samples raises the same incident id.
    again = predicted_incident(verdict_of(), PLACEMENT, T0 + 99)
    assert again.incident_id == incident.incident_id


def test_autonomous_drains_now_and_migrates_monitor_only_recommends() -> None:
    incident = predicted_incident(verdict_of(), PLACEMENT, T0 + 11)
    decision, action, migrate = decide_predicted(policy(), incident, T0 + 12, True)
    assert action is not None and migrate
    assert (action.action, action.node, action.predicted, action.job_id) == ("drain", NODE, True, "4242")
    assert decision.executed and decision.rule.startswith("prediction: drain gpu03 now")
    monitor = load_policy()  # the shipped default: monitor
    decision, action, migrate = decide_predicted(monitor, incident, T0 + 12, True)
    assert action is None and not migrate and not decision.executed and decision.mode == "monitor"
    # decide() (replay, diagnose) reaches the same answer for a predicted incident.
    replayed, expected = decide(policy(), incident, T0 + 12)[1], decide_predicted(policy(), incident, T0 + 12, True)[1]
    assert replayed is not None and expected is not None
    assert replayed.model_dump(exclude={"produced_at"}) == expected.model_dump(exclude={"produced_at"})


@pytest.mark.parametrize("choice", ["drain", "drain_and_requeue", "none"])
def test_a_job_never_seen_to_checkpoint_gets_what_the_policy_says(choice: str) -> None:
    incident = predicted_incident(verdict_of(), PLACEMENT, T0 + 11)
    decision, action, migrate = decide_predicted(policy(without_checkpoints=choice), incident, T0 + 12, False)
    assert not migrate and decision.action == choice
    assert (action.action if action else "none") == choice


def test_a_spent_restart_budget_drains_without_moving_the_job() -> None:
    incident = predicted_incident(verdict_of(), PLACEMENT, T0 + 11)
    _, action, migrate = decide_predicted(policy(), incident, T0 + 12, True, recent_restarts=3)
    assert action is not None and action.action == "drain" and not migrate


def test_a_placeholder_confidence_below_min_confidence_only_recommends() -> None:
    incident = predicted_incident(verdict_of(), PLACEMENT, T0 + 11).model_copy(update={"confidence": 0.5})
    decision, action, migrate = decide_predicted(policy(), incident, T0 + 12, True)
    assert action is None and not migrate and "below min_confidence" in decision.reason


def _begun(book: MigrationBook, before: int | None = 400, wait_s: float = 600.0) -> Incident:
    incident = predicted_incident(verdict_of(), PLACEMENT, T0 + 11)
    decision, _, _ = decide_predicted(policy(), incident, T0 + 12, True)
    started = book.begin(incident, decision, wait_s, before, T0 + 12)
    assert started is not None and started.state == "waiting" and started.deadline == T0 + 12 + wait_s
    return incident


def test_only_a_completed_save_beyond_the_last_checkpoint_ends_the_wait() -> None:
    book = MigrationBook()
    incident = _begun(book)
    # Megatron's async save: the start line is no saved checkpoint; an older step is not the next one.
    assert (
        book.checkpoint(progress([" saving checkpoint at iteration     600 to /ckpt in torch_dist format"], T0 + 20))
        is None
    )
    assert (
        book.checkpoint(progress([" successfully saved checkpoint from iteration     400 to /ckpt"], T0 + 21)) is None
    )
    found = book.checkpoint(progress([" successfully saved checkpoint from iteration     600 to /ckpt"], T0 + 22))
    assert found is not None and found[1] == 600
    action = requeue_action(found[0], T0 + 23, found[1])
    assert (action.action, action.node, action.exclude_node, action.requested_by) == ("requeue", NODE, True, "policy")
    assert action.incident_id == incident.incident_id and not action.predicted
    closed = book.finish("4242", "requeued", T0 + 23, "saved", 600)
    assert closed is not None and (closed.state, closed.checkpoint_step) == ("requeued", 600)
    assert book.pending("4242") is None and book.finish("4242", "fell_back", T0 + 24, "x") is None


def test_a_save_that_states_no_step_counts_once_written_after_the_verdict() -> None:
    book = MigrationBook()
    _begun(book, before=None)
    assert book.checkpoint(progress(["[rank0]: Finished saving the checkpoint in 3.2 seconds."], T0 - 100)) is None
    found = book.checkpoint(progress(["[rank0]: Finished saving the checkpoint in 3.2 seconds."], T0 + 30))
    assert found is not None and found[1] is None


def test_the_deadline_the_tombstone_and_the_end_of_the_job() -> None:
    book = MigrationBook()
    incident = _begun(book, wait_s=60.0)
    assert book.expired(T0 + 71) == [] and book.expired(T0 + 72) == ["4242"]
    closed = book.finish("4242", "fell_back", T0 + 72, "no checkpoint")
    assert closed is not None and closed.state == "fell_back"
    # The same node's verdict raised again (a restarted detector) begins nothing; the job's end forgets it.
    decision, _, _ = decide_predicted(policy(), incident, T0 + 80, True)
    assert book.seen("4242", NODE) and book.begin(incident, decision, 60.0, 400, T0 + 80) is None
    assert book.forget("4242", T0 + 90) is None and not book.seen("4242", NODE)


def test_the_lineage_says_whether_a_job_checkpoints() -> None:
    lineages = Lineages()
    assert lineages.checkpoints("4242") == (False, None)
    lineages.observe_progress(progress([" successfully saved checkpoint at iteration     400 to /ckpt"], T0))
    assert lineages.checkpoints("4242") == (True, 400)


def _drain(node: str, incident: str, predicted: bool) -> Action:
    return Action(
        event_id=f"act-{incident}",
        event_time=T0,
        action_id=f"act-{incident}",
        decision_id=f"dec-{incident}",
        incident_id=incident,
        job_id=None,
        node=node,
        partition="gpu",
        action="drain",
        reason=f"trainmedic {incident}: gpu_hardware",
        requested_by="policy",
        incident_time=T0,
        first_signal_time=T0,
        predicted=predicted,
    )


def _attempt(a: Action, at: float) -> ActionAttempt:
    return ActionAttempt(
        event_id=f"att-{a.action_id}",
        event_time=at,
        action_id=a.action_id,
        incident_id=a.incident_id,
        node=a.node,
        partition=a.partition,
        action=a.action,
        call="drain",
        executor="test",
        predicted=a.predicted,
    )


def test_predictive_drains_have_their_own_cap_and_leave_the_reactive_ones_alone() -> None:
    sched = SimulatedScheduler([f"gpu{i:02d}" for i in range(1, 21)])
    s = GuardrailSettings(max_drains_per_window=1, max_predictive_drains_per_window=1)
    rails = Guardrails(lambda: s, sched)
    first = _drain("gpu01", "inc-p1", predicted=True)
    assert rails.check(first, T0) is None
    rails.count(_attempt(first, T0))
    trip = rails.check(_drain("gpu02", "inc-p2", predicted=True), T0 + 1)
    assert trip is not None and "max_predictive_drains_per_window is 1" in trip[1]
    # The reactive budget is untouched by the predictive drain.
    reactive = _drain("gpu03", "inc-r1", predicted=False)
    assert rails.check(reactive, T0 + 2) is None
    rails.count(_attempt(reactive, T0 + 2))
    assert rails.check(_drain("gpu04", "inc-r2", predicted=False), T0 + 3) is not None
    # And read back after a restart, each kind counts against its own cap again.
    restored = Guardrails(lambda: s, sched)
    restored.restore([_attempt(first, T0), _attempt(reactive, T0 + 2)])
    assert restored.check(_drain("gpu05", "inc-p3", predicted=True), T0 + 4) is not None
    assert restored.check(_drain("gpu06", "inc-r3", predicted=False), T0 + 4) is not None


def _predicted_drain(job: str, node: str) -> Action:
    return _drain(node, f"inc-{job}", predicted=True).model_copy(update={"job_id": job, "node_reported_fault": True})


@pytest.mark.parametrize(
    ("comment", "sent"),
    [
        ("exp42 trainmedic=checkpoint_signal=USR1", "USR1"),
        ("trainmedic=restarts=2,checkpoint_signal=B:USR2", "B:USR2"),
        ("exp42", None),
        ("trainmedic=checkpoint_signal=TERM", None),  # unreadable: never sent
    ],
)
def test_a_migrations_drain_asks_the_job_for_a_checkpoint_only_with_the_signal_it_declares(
    comment: str, sent: str | None
) -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    job = sched.submit("train", 2)
    sched.annotate_job(job, comment)
    node = sched.job_state(job).nodes[0]
    calls: list[str] = []
    executor = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    result = executor.execute(_predicted_drain(job, node), lambda a, call: calls.append(call))
    assert result.status == "done", result
    signals = [c for c in sched.calls if c.startswith("signal")]
    assert signals == ([f"signal {job} {sent}"] if sent else [])
    assert calls == ["drain", "signal"] if sent else calls == ["drain"]
    # Delivered again: the node is drained for the incident already, nothing is sent twice.
    again = executor.execute(_predicted_drain(job, node), lambda a, call: calls.append(call))
    assert again.status == "done" and [c for c in sched.calls if c.startswith("signal")] == signals


def test_the_checkpoint_signal_setting_reads_only_the_user_signals() -> None:
    assert parse_value("checkpoint_signal=USR1", "x").checkpoint_signal == "USR1"
    with pytest.raises(JobSettingError, match="checkpoint_signal=SIG"):
        parse_value("checkpoint_signal=KILL", "x")
    assert checkpoint_signal("trainmedic=monitor,checkpoint_signal=B:USR1") == "B:USR1"
    assert checkpoint_signal("trainmedic=checkpoint_signal=INT") is None


@pytest.mark.parametrize(
    ("comment", "moved"),
    [
        ("exp42 trainmedic=checkpoint_signal=USR1", True),
        ("trainmedic=off", False),
        ("trainmedic=monitor", False),
        ("trainmedic=of", False),  # unreadable: the job is not touched
        ("trainmedic=restarts=0", False),  # its own limit, below the budget
    ],
)
def test_the_jobs_settings_govern_the_move_not_the_drain(comment: str, moved: bool) -> None:
    placement = Placement(
        "4242", (NODE,), "gpu", T0 - 600, "sched-1", job_name="train", user="alice", account="ml", comment=comment
    )
    assert Placement.from_dict(placement.to_dict()) == placement
    incident = predicted_incident(verdict_of(), placement, T0 + 11)
    assert (incident.job_name, incident.user, incident.job_comment) == ("train", "alice", comment)
    decision, action, migrate = decide_predicted(policy(), incident, T0 + 12, True)
    assert action is not None and action.action == "drain" and migrate is moved, decision.rule
    if not moved:
        assert "is not moved" in decision.rule


def test_migrations_the_table_lost_are_read_back_from_the_topics() -> None:
    book = MigrationBook()
    incident = _begun(book)
    waiting = next(iter(book.waiting()))[1]
    states = [MigrationBook.event(waiting, "waiting", T0 + 12, "drained")]
    # A table cut short: nothing of the job. The topic's latest state comes back, with its deadline.
    lost = MigrationBook()
    assert lost.restore(states, [incident], keep=lambda job: job != "4242") == 0  # another worker's job
    assert lost.restore(states, [incident]) == 1
    back = lost.pending("4242")
    assert back is not None and (back["deadline"], back["checkpoint_before"], back["node"]) == (T0 + 612, 400, NODE)
    assert lost.restore(states, [incident]) == 0  # held now: left alone
    # A migration that ended comes back as its tombstone: the same verdict begins nothing again.
    ended = MigrationBook()
    done = [*states, MigrationBook.event(waiting, "requeued", T0 + 30, "saved", 600)]
    assert ended.restore(done, [incident]) == 1 and ended.pending("4242") is None and ended.seen("4242", NODE)
    # Without the incident it began with, nothing is made up.
    assert MigrationBook().restore(states, []) == 0


def test_a_warning_about_the_migrating_node_is_answered_a_failure_supersedes() -> None:
    book = MigrationBook()
    predicted = _begun(book)
    record = book.pending("4242")
    assert record is not None
    # gpu_health's own warning about the same pending remap, as attribution makes it.
    warning = predicted.model_copy(
        update={"kind": "reactive", "incident_id": "inc-warn", "isolate": False, "severity": "warning"}
    )
    assert answered_by(record, warning)
    decision = absorbed_decision(record, warning, "autonomous", T0 + 13)
    assert (decision.action, decision.executed, decision.incident_id) == ("none", False, "inc-warn")
    assert decision.rule.startswith(f"prediction: migration {record['migration_id']} of job 4242 off {NODE}")
    # The node fails first (an Xid 79 is critical), or something about another node: not answered.
    assert not answered_by(record, warning.model_copy(update={"severity": "critical", "isolate": True}))
    assert not answered_by(record, warning.model_copy(update={"culprit_node": "gpu02"}))
