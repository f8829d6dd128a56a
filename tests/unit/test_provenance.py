"""Issue 41: who could have written a piece of evidence (its provenance), and what policy lets it
trigger. Verdict and permission are separate: a job's node-failure line still reads as a node
fault, but job evidence restarts or stops only the job; a node is isolated on kernel, GPU,
scheduler or service evidence about it, or on job evidence the scheduler corroborates. A judgement
that isolated nothing, or isolated on weaker provenance, never absorbs later stronger evidence."""

from __future__ import annotations

import orjson
import pytest

from schemas.events import Anomaly, Evidence, HealthEvent, Incident, KernelEvent, SchedEvent
from streams.attribution import Attributor
from streams.catalog import default_xids
from streams.detectors.external import ExternalHealthDetector
from streams.detectors.xid import XidDetector
from streams.policy import PolicyError, decide, isolation, parse_policy

JOB_NODES = ["gpu01", "gpu02", "gpu03", "gpu04"]
ACTIONS = (
    "actions:\n  gpu_hardware: drain_and_requeue\n  interconnect: requeue\n  hang: requeue\n  user_code: stop\n"
    "  oom: stop\n  numerical: stop\n  storage: none\n  node: drain_and_requeue\n  healthy: none\n"
)
AUTONOMOUS = parse_policy("mode: autonomous\n" + ACTIONS)


def running(job: str, nodes: list[str], t: float) -> SchedEvent:
    return SchedEvent(
        event_id=f"s{job}{t}", event_time=t, kind="job", job_id=job, state="RUNNING", nodes=nodes, partition="gpu"
    )


def node_down(node: str, t: float, state: str = "DOWN", flags: tuple[str, ...] = ("NOT_RESPONDING",)) -> SchedEvent:
    return SchedEvent(
        event_id=f"n{node}{t}",
        event_time=t,
        kind="node",
        node=node,
        state=state,
        flags=list(flags),
        reason="Not responding",
    )


def node_failure_line(job: str, named: str, t: float) -> Anomaly:
    return Anomaly(
        event_id=f"nf-{job}-{named}-{t}",
        event_time=t,
        detector="signatures",
        signature="srun_node_failure",
        category="node",
        severity="critical",
        role="root",
        isolate=True,
        source="job_log",
        provenance="job",
        job_id=job,
        node=named,
        partition="gpu",
        line=f"srun: error: Node failure on {named}",
    )


def xid79(node: str, t: float, provenance: str = "kernel") -> Anomaly:
    e = default_xids()[79]
    return Anomaly.model_validate(
        {
            "event_id": f"x-{node}-{t}",
            "event_time": t,
            "detector": "xid",
            "signature": "xid_79",
            "category": e.category,
            "severity": e.severity,
            "role": e.role,
            "isolate": e.isolate,
            "source": "kernel",
            "provenance": provenance,
            "node": node,
            "line": "NVRM: Xid (PCI:0000:07:00): 79, pid=0, GPU has fallen off the bus.",
        }
    )


# --- where provenance comes from -------------------------------------------------------------


@pytest.mark.parametrize(("reader", "expected"), [("kmsg", "kernel"), ("journald", "kernel"), ("file", "kernel_file")])
def test_a_kernel_line_is_the_kernels_only_from_kmsg_or_journald(reader: str, expected: str) -> None:
    ev = KernelEvent(
        event_id="k",
        event_time=1.0,
        node="gpu02",
        kind="xid",
        xid=79,
        text="NVRM: Xid (PCI:0000:07:00): 79",
        reader=reader,  # type: ignore[arg-type]
    )
    (a,) = XidDetector().detect(ev)
    assert a.provenance == expected


def test_nvsentinel_is_a_service_and_nvrx_runs_with_the_jobs_rights() -> None:
    detector = ExternalHealthDetector()
    for origin, expected in (("nvsentinel", "service"), ("nvrx", "job")):
        ev = HealthEvent(
            event_id=f"h-{origin}",
            event_time=1.0,
            origin=origin,  # type: ignore[arg-type]
            node="gpu02",
            check_name="GpuXidError",
            component="GPU",
            error_codes=["79"],
            is_fatal=True,
            job_id="100" if origin == "nvrx" else None,
        )
        out = detector.detect(ev)
        assert out and {a.provenance for a in out} == {expected}, (origin, out)


@pytest.mark.parametrize(
    ("origin", "authenticated_as", "expected"),
    [
        ("nvsentinel", "service", "service"),
        # The shared token where jobs may hold it: a job could pose as NVSentinel.
        ("nvsentinel", "shared", "job"),
        # A job's credential naming NVSentinel as its origin is still a job's report.
        ("nvsentinel", "job", "job"),
        ("nvrx", "job", "job"),
        ("nvrx", "service", "service"),
    ],
)
def test_the_ingests_authentication_not_the_bodys_origin_decides(
    origin: str, authenticated_as: str, expected: str
) -> None:
    ev = HealthEvent(
        event_id=f"h-{origin}-{authenticated_as}",
        event_time=1.0,
        origin=origin,  # type: ignore[arg-type]
        node="gpu02",
        check_name="GpuXidError",
        component="GPU",
        error_codes=["79"],
        is_fatal=True,
        job_id="100",
        authenticated_as=authenticated_as,  # type: ignore[arg-type]
    )
    out = ExternalHealthDetector().detect(ev)
    assert out and {a.provenance for a in out} == {expected}


def test_events_from_before_provenance_still_decode_with_the_weaker_reading() -> None:
    old = {
        "schema_version": 2,
        "event_id": "a",
        "event_time": 1.0,
        "detector": "xid",
        "signature": "xid_79",
        "category": "gpu_hardware",
        "severity": "critical",
        "role": "root",
        "source": "kernel",
    }
    assert Anomaly.model_validate_json(orjson.dumps(old)).provenance == "kernel_file"
    assert Anomaly.model_validate({**old, "source": "job_log"}).provenance == "job"
    assert Anomaly.model_validate({**old, "source": "external"}).provenance == "job"
    assert Anomaly.model_validate({**old, "source": "external", "facts": {"origin": "nvsentinel"}}).provenance == (
        "service"
    )
    ev = Evidence.model_validate({"source": "gpu", "signature": "s", "time": 1.0, "line": "", "role": "root"})
    assert ev.provenance == "gpu"


# --- the gate --------------------------------------------------------------------------------


def _incident(evidence: list[Evidence], culprit_in_job: bool | None = True, partition: str = "gpu") -> Incident:
    return Incident(
        event_id="inc-1",
        incident_id="inc-1",
        event_time=10.0,
        job_id="100",
        partition=partition,
        job_nodes=JOB_NODES,
        category="node",
        severity="critical",
        culprit_node="gpu02",
        culprit_in_job=culprit_in_job,
        confidence=0.95,
        isolate=True,
        explanation="x",
        evidence=evidence,
        anomaly_ids=["a"],
        first_signal_time=9.0,
    )


LINE = Evidence(
    source="job_log", provenance="job", signature="srun_node_failure", node="gpu02", time=9.0, line="l", role="root"
)


@pytest.mark.parametrize(
    ("extra", "isolates"),
    [
        ([], False),
        (
            [
                Evidence(
                    source="scheduler",
                    provenance="scheduler",
                    signature="slurm_node_down",
                    node="gpu02",
                    time=9.5,
                    line="d",
                    role="collateral",
                )
            ],
            True,
        ),
        (
            [
                Evidence(
                    source="external",
                    provenance="service",
                    signature="nvsentinel_x",
                    node="gpu02",
                    time=9.5,
                    line="s",
                    role="root",
                )
            ],
            True,
        ),
        (
            [
                Evidence(
                    source="external",
                    provenance="job",
                    signature="nvrx_x",
                    node="gpu02",
                    time=9.5,
                    line="r",
                    role="root",
                )
            ],
            False,
        ),
        # About another node: corroborates nothing about gpu02.
        (
            [
                Evidence(
                    source="scheduler",
                    provenance="scheduler",
                    signature="slurm_node_down",
                    node="gpu03",
                    time=9.5,
                    line="d",
                    role="collateral",
                )
            ],
            False,
        ),
        # A node-keyed port-state anomaly from the node's own producer (the IB sysfs producer's kind).
        (
            [
                Evidence(
                    source="kernel",
                    provenance="kernel",
                    signature="ib_port_down",
                    node="gpu02",
                    time=9.5,
                    line="p",
                    role="root",
                )
            ],
            True,
        ),
    ],
)
def test_a_node_is_isolated_only_on_evidence_the_job_could_not_write(extra: list[Evidence], isolates: bool) -> None:
    inc = _incident([LINE, *extra])
    ok, note = isolation(inc)
    assert ok is isolates, note
    d, a = decide(AUTONOMOUS, inc, 11.0)
    assert a is not None
    assert a.action == ("drain_and_requeue" if isolates else "requeue"), d.rule
    if not isolates:
        assert "job evidence only" in d.rule and "isolating gpu02 recommended" in d.reason
        # The restart keeps the job off the node its own output blamed; nothing else is touched.
        assert a.exclude_node and a.node == "gpu02"
    else:
        assert not a.exclude_node


def test_a_relaxed_partition_lets_job_evidence_isolate_its_own_nodes_only() -> None:
    policy = parse_policy("mode: autonomous\nprovenance:\n  job_isolates_own_nodes: [dev*]\n" + ACTIONS)
    d, a = decide(policy, _incident([LINE], partition="dev-a"), 11.0)
    assert a is not None and a.action == "drain_and_requeue" and not a.node_reported_fault
    d, a = decide(policy, _incident([LINE], partition="gpu"), 11.0)
    assert a is not None and a.action == "requeue"
    # Never a node outside the job, relaxed or not.
    d, a = decide(policy, _incident([LINE], culprit_in_job=False, partition="dev-a"), 11.0)
    assert a is None and d.action == "none"


def test_job_cannot_be_listed_as_node_evidence() -> None:
    with pytest.raises(PolicyError, match="never isolates a node on its own"):
        parse_policy("mode: monitor\nprovenance:\n  node_evidence: [kernel, job]\n" + ACTIONS)


def test_a_site_may_rank_syslog_files_out_of_node_evidence() -> None:
    policy = parse_policy(
        "mode: autonomous\nprovenance:\n  node_evidence: [kernel, gpu, scheduler, service]\n" + ACTIONS
    )
    file_xid = Evidence(
        source="kernel", provenance="kernel_file", signature="xid_79", node="gpu02", time=9, line="x", role="root"
    )
    d, a = decide(policy, _incident([file_xid]), 11.0)
    assert a is not None and a.action == "requeue"
    d, a = decide(AUTONOMOUS, _incident([file_xid]), 11.0)
    assert a is not None and a.action == "drain_and_requeue" and a.node_reported_fault


# --- attribution: corroboration and reopening ----------------------------------------------


def test_slurm_reporting_the_node_down_first_corroborates_the_job_line() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    a.observe_sched(node_down("gpu02", 99.0), 99.0)
    a.add(node_failure_line("100", "gpu02", 100.0), now=100.0)
    (inc,) = a.flush(101.5)
    assert inc.isolate and inc.isolatable and inc.culprit_node == "gpu02"
    assert {(e.provenance, e.signature) for e in inc.evidence} == {
        ("job", "srun_node_failure"),
        ("scheduler", "slurm_node_down"),
    }
    d, act = decide(AUTONOMOUS, inc, 102.0)
    assert act is not None and (act.action, act.node) == ("drain_and_requeue", "gpu02")
    # The executor may drain the node Slurm failed, and need not find the job there (Slurm requeues it).
    assert act.node_failed and not act.node_reported_fault
    # A site that does not take the scheduler's word about a node: no drain, no such permission.
    strict = parse_policy("mode: autonomous\nprovenance:\n  node_evidence: [kernel, gpu, service]\n" + ACTIONS)
    d, act = decide(strict, inc, 102.0)
    assert act is not None and act.action == "requeue" and not act.node_failed


def test_slurm_reporting_the_node_down_later_reissues_the_judgement() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    a.add(node_failure_line("100", "gpu02", 100.0), now=100.0)
    (first,) = a.flush(101.5)
    assert first.isolate and not first.isolatable and first.provenance == "job"
    d, act = decide(AUTONOMOUS, first, 102.0)
    assert act is not None and act.action == "requeue" and not act.node_failed
    a.observe_sched(node_down("gpu03", 120.0), 120.0)  # another node: nothing
    assert a.flush(121.0) == []
    a.observe_sched(node_down("gpu02", 127.0, state="IDLE"), 127.0)  # IDLE* not responding
    (again,) = a.flush(128.0)
    assert again.incident_id != first.incident_id and again.isolatable
    assert again.provenance == "job" and any(e.provenance == "scheduler" for e in again.evidence)
    d, act = decide(AUTONOMOUS, again, 129.0)
    assert act is not None and (act.action, act.node) == ("drain_and_requeue", "gpu02")
    a.observe_sched(node_down("gpu02", 130.0), 130.0)  # once only
    assert a.flush(131.0) == []


def test_a_node_in_maintenance_corroborates_nothing() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    down = node_down("gpu02", 99.0, flags=("MAINTENANCE",))
    a.observe_sched(down, 99.0)
    a.add(node_failure_line("100", "gpu02", 100.0), now=100.0)
    (inc,) = a.flush(101.5)
    assert not inc.isolatable


def test_a_no_action_incident_does_not_absorb_a_later_kernel_xid() -> None:
    """Scenario (2): the job names a node outside it (no action); the real Xid 79 on its own node
    35 s later is an incident of its own and drains the node, instead of waiting out the hold."""
    a = Attributor(settle_s=1.0, hold_s=600.0)
    a.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    a.add(node_failure_line("100", "gpu06", 100.0), now=100.0)
    (first,) = a.flush(101.5)
    assert first.culprit_in_job is False
    d, act = decide(AUTONOMOUS, first, 102.0)
    assert act is None and d.action == "none"
    a.add(xid79("gpu02", 135.0).model_copy(update={"job_id": "100"}), now=135.0)
    (second,) = a.flush(136.5)
    assert second.culprit_node == "gpu02" and second.provenance == "kernel"
    d, act = decide(AUTONOMOUS, second, 137.0)
    assert act is not None and (act.action, act.node) == ("drain_and_requeue", "gpu02")


def test_a_job_only_incident_does_not_absorb_a_later_kernel_xid_on_that_node() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    a.add(node_failure_line("100", "gpu02", 100.0), now=100.0)
    assert len(a.flush(101.5)) == 1
    a.add(xid79("gpu02", 110.0).model_copy(update={"job_id": "100"}), now=110.0)
    (second,) = a.flush(111.5)
    assert second.isolatable and second.provenance == "kernel"


def test_a_kernel_file_isolation_is_reopened_by_the_kernel_and_a_kernel_one_holds() -> None:
    a = Attributor(settle_s=1.0)
    a.observe_sched(running("100", JOB_NODES, 50.0), 50.0)
    a.add(xid79("gpu02", 100.0, "kernel_file").model_copy(update={"job_id": "100", "event_id": "f"}), now=100.0)
    (first,) = a.flush(101.5)
    assert first.isolatable and first.provenance == "kernel_file"
    a.add(xid79("gpu02", 105.0, "kernel").model_copy(update={"job_id": "100", "event_id": "k"}), now=105.0)
    (second,) = a.flush(106.5)
    assert second.provenance == "kernel"
    # Same strength again: the cascade of one fault, absorbed.
    a.add(xid79("gpu02", 107.0, "kernel").model_copy(update={"job_id": "100", "event_id": "k2"}), now=107.0)
    assert a.flush(109.0) == []
    # Collateral symptoms and job lines are absorbed as before.
    a.add(node_failure_line("100", "gpu02", 108.0), now=108.0)
    assert a.flush(110.0) == []
