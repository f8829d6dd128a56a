"""The pieces of a validated return to service that need no cluster: the check runner and the
relabel guard (the whole path runs on real Slurm in tests/integration/test_return_to_service_slurm.py)."""

from __future__ import annotations

import pytest

from sinks.backends.base import ActionRefused
from sinks.backends.simulated import SimulatedScheduler
from trainmedic.ops.return_to_service import REPAIR_LABEL, Verdict, repair_reason, run_check


def test_the_check_passes_only_on_exit_zero_and_says_why_it_failed() -> None:
    assert run_check(["true"], 5).passed
    failed = run_check(["sh", "-c", "echo 'GPU 3: FAIL' >&2; exit 3"], 5)
    assert not failed.passed and "exit status 3" in failed.output and "GPU 3: FAIL" in failed.output
    slow = run_check(["sleep", "5"], 0.2)
    assert not slow.passed and "timed out after 0.2 s" in slow.output
    missing = run_check(["/nonexistent/dcgmi", "diag"], 5)
    assert not missing.passed and "could not start" in missing.output


def test_only_trainmedics_own_drain_is_relabelled_and_once() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02", "gpu03"])
    sched.drain_node("gpu01", "NHC: ECC errors")
    with pytest.raises(ActionRefused, match="not drained by trainmedic"):
        sched.relabel_node("gpu01", "trainmedic inc-x: gpu_hardware | repair")
    with pytest.raises(ActionRefused, match="not drained by trainmedic"):
        sched.relabel_node("gpu03", "trainmedic inc-x: gpu_hardware | repair")  # not drained at all
    ours = "trainmedic inc-0123456789abcdef0123: gpu_hardware"
    sched.drain_node("gpu02", ours)
    verdict = Verdict(False, "lemon", lemon_incidents=["inc-a", "inc-b"])
    labelled = repair_reason(ours, verdict)
    assert labelled.startswith(ours) and REPAIR_LABEL in labelled
    assert repair_reason(labelled, verdict) == labelled
    sched.relabel_node("gpu02", labelled)
    state = sched.node_state("gpu02")
    assert state.drained and state.reason == labelled
    assert sched.node_state("gpu01").reason == "NHC: ECC errors"
