"""Attempt lineage (#20 items 1 and 2): attempts across requeues, progress per attempt, reused job
ids, and what policy does with restarts that buy no progress or a cause that follows the job."""

from __future__ import annotations

from typing import Any

from schemas.events import Evidence, Incident, ProgressBatch, ProgressSample, SchedEvent
from streams.lineage import Lineages, RestartHistory
from streams.policy import decide, parse_policy

ACTIONS = (
    "actions:\n  gpu_hardware: drain_and_requeue\n  node: drain_and_requeue\n  interconnect: requeue\n"
    "  hang: requeue\n  user_code: stop\n  oom: stop\n  numerical: stop\n  storage: stop\n  healthy: none\n"
)


def sched(state: str, t: float, restarts: int = 0, name: str = "train", user: str = "alice") -> SchedEvent:
    return SchedEvent(
        event_id=f"s-{state}-{t}",
        event_time=t,
        kind="job",
        job_id="7",
        state=state,
        nodes=["gpu01", "gpu02"],
        job_name=name,
        user=user,
        restart_count=restarts,
    )


def progress(t: float, *steps: int, checkpoint: tuple[str, int | None] | None = None) -> ProgressBatch:
    samples = [ProgressSample(ts=t, step=s, format="megatron") for s in steps]
    if checkpoint is not None:
        fmt, step = checkpoint
        samples.append(ProgressSample(ts=t, step=step, phase="checkpoint", format=fmt))
    return ProgressBatch(event_id=f"p-{t}", event_time=t, job_id="7", samples=samples)


def incident(node: str = "gpu02", category: Any = "gpu_hardware", signature: str = "xid_79", n: int = 1) -> Incident:
    return Incident(
        event_id=f"inc-{n}",
        incident_id=f"inc-{n}",
        event_time=10.0 * n,
        job_id="7",
        partition="gpu",
        category=category,
        severity="critical",
        culprit_node=node,
        culprit_in_job=True,
        confidence=0.95,
        isolate=category == "gpu_hardware",
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=10.0 * n - 1,  # type: ignore[arg-type]
        evidence=[Evidence(source="kernel", signature=signature, node=node, time=1.0, line="l", role="root")],
    )


def test_attempts_follow_requeues_and_judge_progress_against_the_best_before() -> None:
    lin = Lineages()
    first = lin.observe_sched(sched("RUNNING", 1.0))
    assert [(a.attempt, a.restart_count) for a in first] == [(1, 0)]
    lin.observe_progress(progress(2.0, 100, 200))
    # The restart policy ordered, then Slurm's requeue: attempt 1 ends with its cause, 2 opens.
    caused = lin.ended_by(incident(), "gpu02")
    assert caused[0].cause_incident_id == "inc-1" and caused[0].excluded_nodes == ["gpu02"]
    out = lin.observe_sched(sched("PENDING", 3.0, restarts=1))
    assert [(a.attempt, a.ended_at is not None, a.progressed) for a in out] == [(1, True, True), (2, False, None)]
    assert out[1].start_step == 200
    # Attempt 2 replays from its checkpoint and dies before step 200: no progress.
    lin.observe_progress(progress(4.0, 120, 190))
    history = lin.history("7")
    assert (history.no_progress, history.attempt) == (1, 2)
    assert history.previous is not None and (history.previous.node, history.previous.signature) == ("gpu02", "xid_79")
    # Attempt 3 goes past 200: the streak is broken.
    lin.observe_sched(sched("PENDING", 5.0, restarts=2))
    assert lin.history("7").no_progress == 2
    lin.observe_progress(progress(6.0, 250))
    assert lin.history("7").no_progress == 0


def test_a_new_checkpoint_is_progress_and_a_start_line_of_a_format_with_end_lines_is_not() -> None:
    lin = Lineages()
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 100, checkpoint=("megatron:checkpoint_end", 100)))
    lin.observe_sched(sched("PENDING", 3.0, restarts=1))
    lin.observe_progress(progress(4.0, 60, checkpoint=("megatron:checkpoint_start", 100)))
    assert lin.history("7").no_progress == 1  # a save begun is no checkpoint
    lin.observe_progress(progress(5.0, 80, checkpoint=("megatron:checkpoint_end", None)))
    assert lin.history("7").no_progress == 0
    lin.observe_sched(sched("PENDING", 6.0, restarts=2))
    lin.observe_progress(progress(7.0, 90, checkpoint=("hf:checkpoint_start", 90)))
    assert lin.history("7").no_progress == 1  # a save behind the last checkpoint (100) is a replay
    lin.observe_progress(progress(8.0, 95, checkpoint=("hf:checkpoint_start", 110)))
    assert lin.history("7").no_progress == 0  # HF prints one line as it saves


def test_a_job_that_never_reports_progress_is_never_counted_as_making_none() -> None:
    lin = Lineages()
    lin.observe_sched(sched("RUNNING", 1.0))
    for r in range(1, 5):
        lin.observe_sched(sched("PENDING", 1.0 + r, restarts=r))
    assert lin.history("7") == RestartHistory(0, None, 5)


def test_an_attempt_that_reports_nothing_after_earlier_progress_made_none() -> None:
    lin = Lineages()
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 100))
    lin.observe_sched(sched("PENDING", 3.0, restarts=1))
    lin.observe_sched(sched("PENDING", 4.0, restarts=2))
    assert lin.history("7").no_progress == 2


def test_a_reused_job_id_starts_a_new_lineage() -> None:
    lin = Lineages()
    lin.observe_sched(sched("RUNNING", 1.0, restarts=2))
    first = lin.get("7")
    assert first is not None
    # Restart count back down (slurmctld state reset): another job with the same id.
    out = lin.observe_sched(sched("RUNNING", 50.0, restarts=0))
    second = lin.get("7")
    assert second is not None and second["lineage_id"] != first["lineage_id"]
    assert out[0].lineage_id == first["lineage_id"] and out[0].end_reason == "id reused by another job"
    assert out[-1].attempt == 1 and out[-1].lineage_id == second["lineage_id"]
    # Another name is another job too.
    lin.observe_sched(sched("RUNNING", 90.0, restarts=0, name="eval"))
    third = lin.get("7")
    assert third is not None and third["lineage_id"] != second["lineage_id"]
    # GONE: the lineage is dropped (the id may come back as another job).
    lin.observe_sched(sched("GONE", 99.0))
    assert lin.get("7") is None


def test_step_counts_are_held_back_until_flushed_but_attempts_are_written_at_once() -> None:
    store: dict[str, Any] = {}
    lin = Lineages(store)
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 10))  # first report of the attempt: written
    assert store["7"]["attempts"][-1]["reported"] is True
    lin.observe_progress(progress(3.0, 20))
    assert store["7"]["attempts"][-1]["max_step"] == 10 and lin.get("7")["attempts"][-1]["max_step"] == 20  # type: ignore[index]
    assert lin.flush() == 1 and store["7"]["attempts"][-1]["max_step"] == 20
    lin.observe_progress(progress(4.0, 30))
    lin.retain(lambda job: job != "7")  # the partition moved away
    assert lin.flush() == 0


def policy(limit: int = 3) -> Any:
    return parse_policy(
        f"mode: autonomous\nrestart_budget: {{max_restarts: 10, no_progress_limit: {limit}}}\n" + ACTIONS
    )


def test_the_restart_that_would_exceed_the_no_progress_limit_is_not_made() -> None:
    inc = incident(category="hang", node="gpu01", signature="hang").model_copy(update={"isolate": False})
    d, a = decide(policy(2), inc, 11.0, history=RestartHistory(1, None, 2))
    assert a is not None and a.action == "requeue"
    d, a = decide(policy(2), inc, 11.0, history=RestartHistory(2, None, 3))
    assert a is not None and (a.action, a.stop_mode) == ("stop", "hold")
    assert "no progress: 2 restarts in a row" in d.rule and "limit 2" in d.rule


def test_the_same_cause_on_another_node_recommends_stop_not_another_drain() -> None:
    lin = Lineages()
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.ended_by(incident("gpu02", n=1), "gpu02")
    lin.observe_sched(sched("PENDING", 3.0, restarts=1))
    d, a = decide(policy(), incident("gpu03", n=2), 21.0, history=lin.history("7"))
    assert a is None and d.action == "stop" and not d.executed
    assert "same cause (gpu_hardware, xid_79) as the previous attempt (inc-1 on gpu02), now on gpu03" in d.rule
    # Another cause on another node, or the same node again: the policy's action as usual.
    d, a = decide(policy(), incident("gpu03", signature="xid_48", n=2), 21.0, history=lin.history("7"))
    assert a is not None and a.action == "drain_and_requeue"
    d, a = decide(policy(), incident("gpu02", n=2), 21.0, history=lin.history("7"))
    assert a is not None and a.action == "drain_and_requeue"


def test_a_late_batch_of_the_run_before_does_not_count_for_the_new_attempt() -> None:
    lin = Lineages()
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 100))
    lin.observe_sched(sched("PENDING", 10.0, restarts=1))
    lin.observe_progress(progress(5.0, 300))  # written at 5 s, before the requeue at 10 s
    assert lin.history("7").no_progress == 1


def test_the_first_progress_of_an_attempt_is_written_at_once() -> None:
    store: dict[str, Any] = {}
    lin = Lineages(store)
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 100))
    lin.observe_sched(sched("PENDING", 3.0, restarts=1))
    lin.observe_progress(progress(4.0, 50))  # reported, no progress yet: written (first report)
    lin.observe_progress(progress(5.0, 150))  # past 100: progress - not held back for flush()
    assert store["7"]["attempts"][-1]["max_step"] == 150


def test_each_record_of_an_attempt_is_later_than_the_one_before() -> None:
    lin = Lineages()
    opened = lin.observe_sched(sched("RUNNING", 100.0))
    caused = lin.ended_by(incident(n=1).model_copy(update={"event_time": 100.7}), None)
    ended = lin.observe_sched(sched("PENDING", 100.0, restarts=1))  # Slurm's whole second
    times = [opened[0].event_time, caused[0].event_time, ended[0].event_time]
    assert times == sorted(times) and len(set(times)) == 3


def test_a_later_checkpoint_of_the_same_attempt_is_the_one_the_next_attempt_starts_from() -> None:
    store: dict[str, Any] = {}
    lin = Lineages(store)
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 100, checkpoint=("hf:checkpoint_start", 100)))
    # A second save in the same attempt: nothing else about the attempt changes, but the last
    # checkpoint moves on and is written at once (a checkpoint is never held back).
    lin.observe_progress(progress(3.0, checkpoint=("hf:checkpoint_start", 200)))
    assert store["7"]["checkpoint_step"] == 200
    out = lin.observe_sched(sched("PENDING", 4.0, restarts=1))
    assert out[-1].start_checkpoint == 200
    lin.observe_progress(progress(5.0, 90, checkpoint=("hf:checkpoint_start", 150)))
    assert lin.history("7").no_progress == 1  # a save behind the last checkpoint is a replay


def test_held_back_step_counts_reach_the_store_only_when_flushed() -> None:
    store: dict[str, Any] = {}
    lin = Lineages(store)
    lin.observe_sched(sched("RUNNING", 1.0))
    lin.observe_progress(progress(2.0, 10))
    lin.flush()
    for t, step in ((3.0, 20), (4.0, 30), (5.0, 40)):
        lin.observe_progress(progress(t, step))
        assert store["7"]["attempts"][-1]["max_step"] == 10  # the table's value is never changed in place
    assert lin.get("7")["attempts"][-1]["max_step"] == 40  # type: ignore[index]
    assert lin.flush() == 1 and store["7"]["attempts"][-1]["max_step"] == 40
    lin.observe_progress(progress(6.0, 50))
    assert store["7"]["attempts"][-1]["max_step"] == 40
