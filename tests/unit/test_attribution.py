from __future__ import annotations

from schemas.events import Anomaly, Incident, SchedEvent
from streams.attribution import Attributor
from streams.catalog import default_xids

JOB_NODES = ["gpu01", "gpu02", "gpu03", "gpu04"]


def nccl(node: str, rank: int, t: float) -> Anomaly:
    return Anomaly(
        event_id=f"n-{node}-{rank}",
        event_time=t,
        detector="signatures",
        signature="nccl_watchdog_timeout",
        category="interconnect",
        severity="error",
        role="collateral",
        source="job_log",
        job_id="100",
        node=node,
        rank=rank,
        job_nodes=JOB_NODES,
        partition="gpu",
        line=f"[Rank {rank}] Watchdog caught collective operation timeout",
    )


def xid(node: str, code: int, t: float) -> Anomaly:
    e = default_xids()[code]
    return Anomaly(
        event_id=f"x-{node}-{code}",
        event_time=t,
        detector="xid",
        signature=f"xid_{code}",
        category=e.category,
        severity=e.severity,
        role=e.role,
        isolate=e.isolate,
        source="kernel",
        provenance="kernel",  # read from /dev/kmsg
        node=node,
        line=f"NVRM: Xid (PCI:0000:07:00): {code}, pid=0",
        meaning=e.meaning,
    )


def running(job: str, nodes: list[str], t: float) -> SchedEvent:
    return SchedEvent(
        event_id=f"s{job}{t}", event_time=t, kind="job", job_id=job, state="RUNNING", nodes=nodes, partition="gpu"
    )


def test_xid_beats_nccl_cascade_one_incident() -> None:
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    # The cascade arrives first (ranks time out), the kernel line a moment later.
    for i, n in enumerate(["gpu01", "gpu03", "gpu04"]):
        a.add(nccl(n, i * 8, 10.0), now=10.0)
    a.add(xid("gpu02", 79, 9.5), now=10.2)
    assert a.flush(10.5) == []  # still collecting
    (inc,) = a.flush(15.1)
    # Facts only: the fault lives on gpu02, whose own kernel reported it (policy picks the action).
    assert (inc.job_id, inc.culprit_node, inc.category, inc.isolate, inc.isolatable) == (
        "100",
        "gpu02",
        "gpu_hardware",
        True,
        True,
    )
    assert "recommended_action" not in Incident.model_fields
    assert {e.signature for e in inc.evidence} == {"xid_79", "nccl_watchdog_timeout"}
    assert inc.confidence >= 0.9 and inc.first_signal_time == 9.5
    assert "gpu01" in inc.explanation and "explained by it" in inc.explanation
    assert a.pending() == 0


def test_late_cascade_is_absorbed_not_a_new_incident() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 1.0), now=1.0)
    a.add(xid("gpu02", 79, 5.0), now=5.0)  # node-keyed kernel anomaly: job found by allocation
    (inc,) = a.flush(6.1)
    assert inc.job_id == "100" and inc.culprit_node == "gpu02"
    for i, n in enumerate(["gpu01", "gpu03"]):
        a.add(nccl(n, i, 600.0), now=600.0)
    assert a.flush(700.0) == [] and a.absorbed == 2


def test_job_running_again_reopens() -> None:
    a = Attributor(settle_s=1.0)
    a.add(xid("gpu02", 79, 5.0), now=5.0)
    a.add(nccl("gpu01", 0, 5.0), now=5.0)
    assert len(a.flush(6.5)) == 1
    a.observe_sched(running("100", ["gpu01", "gpu03", "gpu04", "gpu05"], 20.0), now=20.0)
    a.add(nccl("gpu05", 24, 30.0), now=30.0)
    assert len(a.flush(40.0)) == 1


def test_collateral_only_waits_then_names_no_culprit() -> None:
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    for i, n in enumerate(["gpu01", "gpu03", "gpu04"]):
        a.add(nccl(n, i, 10.0), now=10.0)
    assert a.flush(12.0) == []
    (inc,) = a.flush(15.0)
    assert inc.culprit_node is None and inc.category == "interconnect" and not inc.isolate
    assert "gpu02 is the only node" in inc.explanation and inc.confidence < 0.6


def test_node_without_job_gives_node_incident() -> None:
    a = Attributor(settle_s=1.0)
    a.add(xid("gpu07", 48, 1.0), now=1.0)
    (inc,) = a.flush(2.5)
    assert inc.job_id is None and inc.culprit_node == "gpu07" and inc.isolate


def test_redelivered_anomaly_counts_once_and_ids_are_stable() -> None:
    def run() -> str:
        a = Attributor(settle_s=1.0)
        a.add(xid("gpu02", 79, 5.0), now=5.0)
        a.add(xid("gpu02", 79, 5.0), now=5.1)
        (inc,) = a.flush(7.0)
        assert len(inc.anomaly_ids) == 1
        return inc.incident_id

    assert run() == run()


def test_restored_incident_absorbs_redelivered_and_late_evidence_until_the_job_runs_again() -> None:
    """A restarted worker takes back the published incidents and job states: the same
    evidence, or more of the same cascade, is not a second incident."""
    before = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    before.observe_sched(running("100", JOB_NODES, 1.0), now=1.0)
    before.add(xid("gpu02", 79, 9.5), now=10.0)
    (inc,) = before.flush(11.5)
    assert inc.job_id == "100"

    after = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    assert after.restore([inc], [running("100", JOB_NODES, 1.0)], now=20.0) == 1
    after.add(xid("gpu02", 79, 9.5), now=20.0)  # redelivered: kernel evidence carries no job
    after.add(nccl("gpu01", 0, 19.0), now=20.0)  # late collateral of the same fault
    assert after.flush(40.0) == [] and after.absorbed == 2
    # The job runs again after the incident: a new fault is a new incident, but the old
    # Xid line read once more is still the old evidence.
    after.observe_sched(running("100", ["gpu01", "gpu03", "gpu04", "gpu05"], 41.0), now=41.0)
    after.add(xid("gpu02", 79, 9.5), now=42.0)
    assert after.flush(50.0) == []
    later = xid("gpu03", 48, 43.0).model_copy(update={"event_id": "x-gpu03-48-new"})
    after.add(later, now=43.0)
    (second,) = after.flush(50.0)
    assert second.job_id == "100" and second.culprit_node == "gpu03" and second.incident_id != inc.incident_id


def test_restore_takes_back_pending_evidence_a_dead_worker_held_only_in_memory() -> None:
    """The collateral of a fault was consumed (and its offsets perhaps committed) by a worker
    that died before the root cause came: a restarted worker re-reads it from the anomalies
    topic, so the Xid that follows joins the job's incident instead of standing alone."""
    before = Attributor(settle_s=1.0, collateral_wait_s=60.0)
    collateral = [nccl(n, i * 8, 10.0) for i, n in enumerate(["gpu01", "gpu03", "gpu04"])]
    for a in collateral:
        before.add(a, now=10.0)
    assert before.flush(12.0) == []  # still waiting for a cause when it dies

    after = Attributor(settle_s=1.0, collateral_wait_s=60.0)
    assert after.restore([], [], now=20.0, anomalies=[(10.0, a) for a in collateral]) == 0
    assert after.pending() == 1
    assert after.flush(21.0) == []  # its window counts from when the evidence came (10 s), not the restart
    after.add(xid("gpu02", 79, 21.0), now=21.0)  # no job on the kernel line: the job comes from the evidence
    (inc,) = after.flush(22.5)
    assert (inc.job_id, inc.culprit_node, inc.category) == ("100", "gpu02", "gpu_hardware")
    assert set(inc.anomaly_ids) == {a.event_id for a in collateral} | {"x-gpu02-79"}


def test_restored_anomalies_of_a_published_incident_are_absorbed_not_reported_again() -> None:
    before = Attributor(settle_s=1.0)
    evidence = [xid("gpu02", 79, 9.5), nccl("gpu01", 0, 10.0)]
    for a in evidence:
        before.add(a, now=10.0)
    (inc,) = before.flush(11.5)
    after = Attributor(settle_s=1.0)
    after.restore([inc], [], now=20.0, anomalies=[(10.0, a) for a in evidence])
    assert after.pending() == 0 and after.flush(40.0) == []


def test_collateral_absorbed_late_by_an_old_incident_is_not_a_new_incident_after_a_restart() -> None:
    """An incident at 10 s holds its job for 600 s; a late NCCL timeout at 400 s was absorbed. The
    worker restarts at 650 s, when the hold is over: replayed at 400 s, the timeout is absorbed
    again, as it was, instead of opening a group that would become a second incident."""
    before = Attributor(settle_s=1.0, collateral_wait_s=5.0, hold_s=600.0)
    before.observe_sched(running("100", JOB_NODES, 1.0), now=1.0)
    before.add(xid("gpu02", 79, 9.5), now=10.0)
    (inc,) = before.flush(11.5)
    assert inc.job_id == "100"
    late = nccl("gpu01", 0, 400.0)
    before.add(late, now=400.0)
    assert before.absorbed == 1
    after = Attributor(settle_s=1.0, collateral_wait_s=5.0, hold_s=600.0)
    after.restore([inc], [running("100", JOB_NODES, 1.0)], now=650.0, anomalies=[(400.0, late)])
    assert after.pending() == 0 and after.flush(700.0) == []


def test_restore_forgets_incidents_older_than_the_hold() -> None:
    before = Attributor(settle_s=1.0, hold_s=60.0)
    before.add(xid("gpu02", 79, 9.5), now=10.0)
    (inc,) = before.flush(11.5)
    after = Attributor(settle_s=1.0, hold_s=60.0)
    assert after.restore([inc], [], now=500.0) == 0
    after.add(xid("gpu02", 79, 499.0).model_copy(update={"event_id": "x-new"}), now=500.0)
    assert len(after.flush(502.0)) == 1


def test_incident_carries_the_job_owner_from_the_scheduler() -> None:
    a = Attributor(settle_s=1.0)
    owner = running("100", JOB_NODES, 1.0).model_copy(
        update={"job_name": "pretrain-70b", "user": "alice", "account": "llm"}
    )
    a.observe_sched(owner, now=1.0)
    a.add(nccl("gpu01", 0, 9.0), now=9.0)  # log evidence re-states the placement, without an owner
    a.add(xid("gpu02", 79, 9.5), now=10.0)
    (inc,) = a.flush(11.5)
    assert (inc.job_id, inc.job_name, inc.user, inc.account) == ("100", "pretrain-70b", "alice", "llm")


def test_incident_carries_slurms_restart_count_of_the_job() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 1.0).model_copy(update={"restart_count": 2}), now=1.0)
    a.add(xid("gpu02", 79, 5.0), now=5.0)
    (inc,) = a.flush(6.1)
    assert inc.job_id == "100" and inc.job_restarts == 2


def test_one_xid_seen_by_the_kernel_log_nvml_and_nvsentinel_is_one_piece_of_evidence() -> None:
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.observe_sched(running("100", JOB_NODES, 1.0), now=1.0)
    kernel = xid("gpu02", 79, 10.0)
    nvml = kernel.model_copy(update={"event_id": "g-gpu02-79", "source": "gpu", "detector": "gpu_health", "gpu": 3})
    nvsentinel = kernel.model_copy(update={"event_id": "e-gpu02-79", "source": "external", "detector": "external"})
    other_gpu = nvml.model_copy(update={"event_id": "g-gpu02-79-gpu5", "gpu": 5, "event_time": 10.4})
    for anomaly, at in ((kernel, 10.0), (nvml, 10.1), (nvsentinel, 10.2), (nvml, 10.3), (other_gpu, 10.4)):
        a.add(anomaly, now=at)
    (inc,) = a.flush(12.0)
    assert inc.job_id == "100" and inc.culprit_node == "gpu02"
    # NVML's report names the GPU; it is the one kept. GPU 5's Xid is another fault, kept apart.
    assert sorted((e.source, e.gpu or 0) for e in inc.evidence if e.signature == "xid_79") == [("gpu", 3), ("gpu", 5)]
    # Every report is taken by the incident (audited as its), the redelivered one once.
    assert inc.anomaly_ids == sorted(["x-gpu02-79", "g-gpu02-79", "e-gpu02-79", "g-gpu02-79-gpu5"])
    assert inc.first_signal_time == 10.0
    assert "counted once" in inc.explanation and "source kernel" in inc.explanation
    assert a.flush(20.0) == []


def test_the_same_signature_from_one_source_on_two_nodes_is_not_merged() -> None:
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.observe_sched(running("100", JOB_NODES, 1.0), now=1.0)
    a.add(xid("gpu02", 79, 10.0), now=10.0)
    other = xid("gpu03", 79, 10.1).model_copy(update={"source": "gpu"})
    a.add(other, now=10.1)
    (inc,) = a.flush(12.0)
    assert sorted(e.node or "" for e in inc.evidence) == ["gpu02", "gpu03"]


def test_of_two_reports_of_one_fault_the_stronger_is_judged_and_keeps_the_gpu() -> None:
    """Another system's non-fatal note of an Xid, first, must not hide the kernel's fatal line."""
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.observe_sched(running("100", JOB_NODES, 1.0), now=1.0)
    kernel = xid("gpu02", 79, 10.0)
    weak = kernel.model_copy(
        update={"event_id": "e-weak", "source": "external", "severity": "warning", "isolate": False, "gpu": 4}
    )
    a.add(weak, now=10.0)
    a.add(kernel, now=10.1)
    (inc,) = a.flush(12.0)
    assert inc.isolate and inc.severity == kernel.severity and inc.culprit_gpu == 4
    assert [(e.source, e.gpu) for e in inc.evidence] == [("kernel", 4)]
    assert inc.anomaly_ids == ["e-weak", "x-gpu02-79"]


def test_retain_drops_the_groups_of_jobs_another_worker_now_judges() -> None:
    att = Attributor(settle_s=1.0, collateral_wait_s=60.0)
    att.add(nccl("gpu01", 0, 10.0), now=10.0)  # job 100
    att.add(xid("gpu09", 79, 10.0), now=10.0)  # no job known on gpu09: node group
    assert att.pending() == 2
    assert att.retain(lambda key: key != "100") == 1
    assert att.pending() == 1
    (inc,) = att.flush(12.0)
    assert inc.job_id is None and inc.culprit_node == "gpu09"


def _slowdown(t: float) -> Anomaly:
    """The throughput detector's job-wide slowdown: a root with no known cause."""
    return Anomaly(
        event_id="tp-1",
        event_time=t,
        detector="throughput",
        signature="throughput_drop",
        category="unknown",
        severity="warning",
        role="root",
        source="job_log",
        job_id="100",
        node="gpu04",
        job_nodes=JOB_NODES,
        partition="gpu",
        line="throughput 0.71 steps/s over 5 reports, 29% below the baseline",
    )


def _straggler(node: str, t: float) -> Anomaly:
    return Anomaly(
        event_id=f"st-{node}",
        event_time=t,
        detector="straggler",
        signature="straggler",
        category="gpu_hardware",
        severity="warning",
        role="root",
        isolate=True,
        source="gpu",
        job_id="100",
        node=node,
        job_nodes=JOB_NODES,
        partition="gpu",
        line=f"{node}: HW thermal slowdown on GPU 3",
    )


def test_a_cause_found_after_an_unexplained_slowdown_is_its_own_incident() -> None:
    """The job-wide slowdown is seen at once, the throttled node behind it 30 s later: that node
    must still be named and isolated, not absorbed into the incident that found no cause."""
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.add(_slowdown(100.0), now=100.0)
    (first,) = a.flush(105.5)  # no recognised cause: it waits collateral_wait_s for one
    assert first.category == "unknown"
    a.add(_straggler("gpu02", 130.0), now=130.0)
    (second,) = a.flush(131.5)
    assert (second.category, second.culprit_node, second.isolate) == ("gpu_hardware", "gpu02", True)
    assert second.incident_id != first.incident_id
    # Now the job's fault is explained: what follows is absorbed, as always.
    a.add(_straggler("gpu03", 140.0), now=140.0)
    a.add(nccl("gpu01", 0, 141.0), now=141.0)
    assert a.flush(150.0) == []


def test_after_an_unexplained_incident_a_non_isolating_cause_stays_absorbed() -> None:
    """A hang after an unexplained crash is its consequence: no second incident, no action."""
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.add(_slowdown(100.0), now=100.0)
    assert len(a.flush(105.5)) == 1
    hang = _straggler("gpu02", 130.0).model_copy(
        update={"event_id": "h-1", "signature": "hang", "category": "hang", "isolate": False, "detector": "hang"}
    )
    a.add(hang, now=130.0)
    assert a.flush(140.0) == []
    # And after an explained incident an isolating cause is absorbed too (the hold, unchanged).
    b = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    b.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    b.add(xid("gpu02", 79, 99.0), now=100.0)
    assert len(b.flush(101.5)) == 1
    b.add(_straggler("gpu03", 130.0), now=130.0)
    assert b.flush(140.0) == []


def test_after_an_unexplained_incident_any_recognised_cause_opens_its_own_judgement() -> None:
    """Online, `unknown` never holds later evidence back: an OOM (a cause that isolates nothing)
    after an unexplained crash is an incident of its own at once; a collateral timeout and a bare
    crash marker after it stay absorbed."""
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.add(_slowdown(100.0), now=100.0)
    (first,) = a.flush(105.5)
    assert first.category == "unknown"
    a.add(nccl("gpu01", 0, 110.0), now=110.0)  # collateral: absorbed
    crash = _slowdown(111.0).model_copy(update={"event_id": "c-1", "signature": "crash_exit_code"})
    a.add(crash, now=111.0)  # a bare crash marker (unknown): absorbed
    assert a.flush(120.0) == []
    oom = _straggler("gpu03", 130.0).model_copy(
        update={
            "event_id": "o-1",
            "signature": "cuda_oom",
            "category": "oom",
            "isolate": False,
            "detector": "signatures",
        }
    )
    a.add(oom, now=130.0)
    (second,) = a.flush(131.5)  # a recognised cause: settle_s, not a hold
    assert (second.category, second.isolate) == ("oom", False) and second.incident_id != first.incident_id
