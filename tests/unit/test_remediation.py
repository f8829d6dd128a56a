"""Remediation after a drain (#20 item 4): chosen by the deciding Xid's NVIDIA resolution bucket,
carried out once by the executor (the whole path on real Slurm: tests/integration/test_remediation_slurm.py)."""

from __future__ import annotations

import time
from typing import Any

from schemas.events import Action, Evidence, Incident
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorSettings
from streams.policy import decide, parse_policy, remediation_for

ACTIONS = (
    "actions: {gpu_hardware: drain_and_requeue, node: drain_and_requeue, interconnect: requeue, hang: requeue, "
    "user_code: stop, oom: stop, numerical: stop, storage: stop, healthy: none}\n"
)


def incident(xid: int, node: str = "gpu02") -> Incident:
    return Incident(
        event_id="inc-0123456789abcdef0123",
        incident_id="inc-0123456789abcdef0123",
        event_time=10.0,
        category="gpu_hardware",
        severity="critical",
        culprit_node=node,
        confidence=0.95,
        isolate=True,
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=9.0,
        evidence=[Evidence(source="kernel", signature=f"xid_{xid}", node=node, time=9.0, line="l", role="root")],
    )


def test_the_bucket_of_the_deciding_xid_chooses_the_remediation() -> None:
    on = parse_policy("mode: autonomous\nremediation: {enabled: true}\n" + ACTIONS)
    assert remediation_for(on, incident(79)) == ("reboot", "RESTART_BM")
    assert remediation_for(on, incident(48)) == ("repair", "WORKFLOW_XID_48")
    assert remediation_for(on, incident(13)) is None  # RESTART_APP: the application, not the node
    off = parse_policy("mode: autonomous\n" + ACTIONS)
    assert remediation_for(off, incident(79)) is None  # off unless the policy enables it
    decision, action = decide(on, incident(79), 11.0)
    assert action is not None
    assert (action.action, action.remediation, action.remediation_bucket) == (
        "drain_and_requeue",
        "reboot",
        "RESTART_BM",
    )
    assert decision.remediation == "reboot" and "then reboot the node (RESTART_BM)" in decision.reason


def action(remediation: Any, bucket: str) -> Action:
    now = time.time()
    return Action(
        event_id="act-r1",
        event_time=now,
        action_id="act-r1",
        decision_id="dec-r1",
        incident_id="inc-0123456789abcdef0123",
        node="gpu02",
        partition="gpu",
        action="drain_and_requeue",
        remediation=remediation,
        remediation_bucket=bucket,
        reason="trainmedic inc-0123456789abcdef0123: gpu_hardware",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now,
        node_reported_fault=True,
    )


def test_a_reboot_is_requested_once_even_when_the_action_is_delivered_again() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    calls: list[str] = []
    first = ex.execute(action("reboot", "RESTART_BM"), lambda a, call: calls.append(call))
    assert first.status == "done", first
    assert any("reboot gpu02: requested ASAP (RESTART_BM)" in s for s in first.steps)
    again = ex.execute(action("reboot", "RESTART_BM"), lambda a, call: calls.append(call))
    assert again.status == "done" and any("already requested" in s for s in again.steps)
    assert calls.count("reboot") == 1 and sched.calls.count("reboot gpu02") == 1
    state = sched.node_state("gpu02")
    assert state.drained and "REBOOT_REQUESTED" in state.flags and "reboot (RESTART_BM)" in (state.reason or "")


def test_a_repair_bucket_labels_the_drain_for_a_person() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    result = ex.execute(action("repair", "CONTACT_SUPPORT"), lambda a, call: None)
    assert result.status == "done", result
    reason = sched.node_state("gpu02").reason or ""
    assert reason.startswith("trainmedic inc-0123456789abcdef0123") and "repair: CONTACT_SUPPORT" in reason
    again = ex.execute(action("repair", "CONTACT_SUPPORT"), lambda a, call: None)
    assert (sched.node_state("gpu02").reason or "").count("repair: CONTACT_SUPPORT") == 1
    assert any("already there" in s for s in again.steps)


def test_a_reboot_the_backend_refuses_leaves_the_node_drained_and_says_so() -> None:
    class NoReboot(SimulatedScheduler):
        def reboot_node(self, node: str, reason: str) -> str:
            from sinks.backends.base import BackendError

            raise BackendError("scontrol: error: RebootProgram isn't defined")

    sched = NoReboot(["gpu01", "gpu02"])
    result = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01)).execute(
        action("reboot", "RESTART_BM"), lambda a, call: None
    )
    assert result.status == "done" and sched.node_state("gpu02").drained
    assert any("reboot gpu02 not done (scontrol: error: RebootProgram isn't defined)" in s for s in result.steps)


def test_a_reboot_already_done_is_not_asked_again() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    ex.execute(action("reboot", "RESTART_BM"), lambda a, call: None)
    sched._node("gpu02").reboot = False  # the reboot is over; the node is back, drained, our reason kept
    again = ex.execute(action("reboot", "RESTART_BM"), lambda a, call: None)
    assert sched.calls.count("reboot gpu02") == 1 and any("already requested" in s for s in again.steps)


def test_a_gpu_reset_is_for_the_gpu_whose_xid_called_for_it() -> None:
    on = parse_policy("mode: autonomous\nremediation: {enabled: true}\n" + ACTIONS)
    xid = incident(95)
    # The incident names GPU 5 (other evidence); the RESET_GPU Xid came from GPU 2.
    xid = xid.model_copy(update={"culprit_gpu": 5, "evidence": [xid.evidence[0].model_copy(update={"gpu": 2})]})
    decision, action = decide(on, xid, 11.0)
    assert decision.remediation == "reset_gpu" and action is not None and action.culprit_gpu == 2
    # An Xid that names no GPU: the node agent resets every GPU of the idle node.
    anyone = xid.model_copy(update={"evidence": [xid.evidence[0].model_copy(update={"gpu": None})]})
    assert decide(on, anyone, 11.0)[1].culprit_gpu is None  # type: ignore[union-attr]
