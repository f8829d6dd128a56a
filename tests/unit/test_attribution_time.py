"""Time-aware attribution (issue 42, deliverable 4): evidence far apart in time is not one cascade, and an
older fault does not explain a newer one of another class - in the Attributor (online) and in
`trainmedic diagnose` (offline, which reports the last failure and names the earlier one)."""

from __future__ import annotations

from pathlib import Path

from schemas.events import Anomaly
from streams.attribution import CASCADE_WINDOW_S, Attributor, cascades
from tests.unit.test_attribution import JOB_NODES, nccl, xid
from trainmedic.ops.diagnose import diagnose_paths
from trainmedic.settings import Settings

T0 = 1_765_000_000.0  # a wall-clock time (the explanation prints it as HH:MM:SS)


def oom(rank: int, t: float) -> Anomaly:
    return Anomaly(
        event_id=f"o-{rank}-{t}",
        event_time=t,
        detector="signatures",
        signature="cuda_oom",
        category="oom",
        severity="error",
        role="root",
        source="job_log",
        job_id="100",
        rank=rank,
        job_nodes=JOB_NODES,
        partition="gpu",
        line="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    )


def job_xid(node: str, t: float) -> Anomaly:
    return xid(node, 79, t).model_copy(update={"job_id": "100", "job_nodes": JOB_NODES, "event_id": f"x-{t}"})


def test_the_default_window_is_torchs_default_nccl_timeout() -> None:
    assert CASCADE_WINDOW_S == 600.0 and Attributor().cascade_window_s == 600.0
    # The streams worker's setting (TRAINMEDIC_CASCADE_WINDOW_S) defaults to the same.
    assert Settings.model_fields["cascade_window_s"].default == CASCADE_WINDOW_S


def test_an_old_fault_does_not_explain_a_newer_one_of_another_class() -> None:
    a = Attributor(settle_s=0.0, collateral_wait_s=0.0)
    a.add(job_xid("gpu02", T0), now=0.0)
    later = T0 + 3 * 3600
    a.add(oom(5, later), now=0.0)
    for i, n in enumerate(["gpu01", "gpu03"]):
        a.add(nccl(n, i, later + 30), now=0.0)
    old, new = a.flush(1.0)
    # Each cascade judged on its own, oldest first: the Xid is not the root of the OOM hours later.
    assert (old.category, old.culprit_node, old.anomaly_ids) == ("gpu_hardware", "gpu02", [f"x-{T0}"])
    assert (new.category, new.culprit_rank, new.isolate) == ("oom", 5, False)
    assert "xid_79" not in {e.signature for e in new.evidence}
    assert new.first_signal_time == later
    assert "an earlier, separate fault" in new.explanation and "gpu_hardware (xid_79 on gpu02" in new.explanation
    assert "3.0 h before" in new.explanation
    assert "earlier" not in old.explanation


def test_evidence_within_the_window_is_still_one_cascade() -> None:
    a = Attributor(settle_s=0.0, collateral_wait_s=0.0)
    a.add(job_xid("gpu02", T0), now=0.0)
    # The other ranks time out just inside torch's 600 s default after the GPU fell off the bus.
    for i, n in enumerate(["gpu01", "gpu03", "gpu04"]):
        a.add(nccl(n, i, T0 + 590), now=0.0)
    (inc,) = a.flush(1.0)
    assert (inc.category, inc.culprit_node) == ("gpu_hardware", "gpu02")
    assert len(inc.anomaly_ids) == 4 and "explained by it" in inc.explanation


def test_a_longer_configured_collective_timeout_stretches_its_own_link() -> None:
    late = nccl("gpu01", 0, T0 + 1500).model_copy(update={"facts": {"timeout_ms": "1800000"}})
    assert len(cascades([job_xid("gpu02", T0), late], CASCADE_WINDOW_S)) == 1
    plain = nccl("gpu01", 0, T0 + 1500)
    assert len(cascades([job_xid("gpu02", T0), plain], CASCADE_WINDOW_S)) == 2


def test_a_chain_of_evidence_each_within_the_window_is_one_cascade() -> None:
    chain = [job_xid("gpu02", T0), nccl("gpu01", 0, T0 + 500), nccl("gpu03", 1, T0 + 1000)]
    assert [len(c) for c in cascades(chain, CASCADE_WINDOW_S)] == [3]


def test_untimed_evidence_never_splits_and_other_clocks_are_not_compared() -> None:
    x, t = job_xid("gpu02", T0), nccl("gpu01", 0, T0 + 90 * 86400)
    assert len(cascades([x, t], CASCADE_WINDOW_S)) == 2
    # A line timed by line order, or by another file's clock, says nothing about the gap.
    assert len(cascades([x, t], CASCADE_WINDOW_S, untimed={t.event_id})) == 1
    assert len(cascades([x, t], CASCADE_WINDOW_S, clocks={x.event_id: "kern.log", t.event_id: "job.out"})) == 1
    # One clock: the gap counts.
    assert len(cascades([x, t], CASCADE_WINDOW_S, clocks={x.event_id: "a", t.event_id: "a"})) == 2


def test_a_held_incident_does_not_absorb_evidence_from_long_after_its_cascade() -> None:
    a = Attributor(settle_s=1.0, collateral_wait_s=5.0)
    a.add(job_xid("gpu02", T0), now=10.0)
    (first,) = a.flush(11.5)
    # Within the hold (arrival time) and within the window (event time): absorbed.
    a.add(nccl("gpu01", 0, T0 + 300), now=12.0)
    assert a.absorbed == 1
    # A backlog delivers a timeout from 2 h later while the incident still holds the job: another cascade.
    a.add(nccl("gpu03", 1, T0 + 7200), now=13.0)
    assert a.absorbed == 1 and a.pending() == 1
    (second,) = a.flush(20.0)
    assert second.incident_id != first.incident_id
    assert (second.category, second.culprit_node) == ("interconnect", None)


def test_absorbed_evidence_extends_the_held_cascade() -> None:
    a = Attributor(settle_s=1.0)
    a.add(job_xid("gpu02", T0), now=10.0)
    a.flush(11.5)
    a.add(nccl("gpu01", 0, T0 + 550), now=12.0)
    a.add(nccl("gpu03", 1, T0 + 1100), now=13.0)  # 1100 s after the Xid, 550 s after the last link
    assert a.absorbed == 2 and a.pending() == 0


XID = "{t} gpu02 kernel: NVRM: Xid (PCI:0000:10:00): 79, pid=0, GPU has fallen off the bus."
OOM_KILL = (
    "{t} gpu03 kernel: Out of memory: Killed process 41234 (python3) total-vm:98765432kB, anon-rss:61234567kB, "
    "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:123456kB oom_score_adj:0"
)


def _kern(tmp_path: Path, oom_at: str) -> Path:
    path = tmp_path / "kern.log"
    path.write_text(XID.format(t="Dec 06 10:00:00") + "\n" + OOM_KILL.format(t=oom_at) + "\n")
    return path


def test_diagnose_reports_the_last_failure_and_names_the_earlier_one(tmp_path: Path) -> None:
    report = diagnose_paths([_kern(tmp_path, "Dec 06 14:00:00")])
    assert (report["category"], report["action"]) == ("oom", "stop")
    assert [e["signature"] for e in report["evidence"]] == ["oom_killer"]
    assert "an earlier, separate fault" in report["explanation"]
    assert "gpu_hardware (xid_79 on gpu02), 4.0 h before" in report["explanation"]


def test_diagnose_keeps_evidence_within_the_window_one_cascade(tmp_path: Path) -> None:
    report = diagnose_paths([_kern(tmp_path, "Dec 06 10:05:00")])
    assert (report["category"], report["culprit"], report["action"]) == ("gpu_hardware", "gpu02", "drain_and_requeue")
    assert "earlier, separate" not in report["explanation"]
