"""SlurmCliBackend against the REAL local Slurm clusters: every test runs on
22.05 (infra/slurm/start.sh) and on 24.11 (infra/slurm/start-2411.sh).

Needs root (the clusters run as SlurmUser=root and mknod fake GPU devices).
Tests are order-independent: every test starts with gpu01..gpu04 idle and
undrained, and cancels its jobs / resumes its nodes on teardown.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from sinks.backends.base import BackendError, SchedulerBackend
from sinks.backends.slurm_cli import LocalRunner, SlurmCliBackend
from tests.conftest import Cluster

REPO = Path(__file__).resolve().parents[2]
START = REPO / "infra" / "slurm" / "start.sh"
STOP = REPO / "infra" / "slurm" / "stop.sh"
NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
TERMINAL = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"}

pytestmark = pytest.mark.slurm


def _run(cluster: Cluster, *argv: str) -> str:
    proc = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


def _wait_for(what: str, probe: Callable[[], bool], timeout: float, interval: float = 0.25) -> float:
    """Poll probe until true; return the elapsed seconds (for reporting only)."""
    t0 = time.monotonic()
    while not probe():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0


@pytest.fixture
def backend(slurm_any: Cluster) -> SlurmCliBackend:
    return SlurmCliBackend(slurm_any.runner())


@pytest.fixture(autouse=True)
def clean_cluster(slurm_any: Cluster, backend: SlurmCliBackend) -> Iterator[None]:
    """Every test starts and ends with no live jobs and all nodes idle/undrained."""

    def reset() -> None:
        live = _run(slurm_any, "squeue", "-h", "-t", "all", "-o", "%i %T").split()
        ids = [j for j, st in zip(live[::2], live[1::2], strict=True) if st not in TERMINAL]
        if ids:
            _run(slurm_any, "scancel", *ids)
        for node in NODES:
            state = backend.node_state(node)
            if state.drained or state.state in ("DOWN", "FAIL"):
                backend.resume_node(node)

        def all_idle() -> bool:
            states = [backend.node_state(n) for n in NODES]
            return all(s.state == "IDLE" and not s.flags for s in states)

        _wait_for("all nodes idle", all_idle, timeout=30)

    reset()
    yield
    reset()


@pytest.fixture
def submit(slurm_any: Cluster, backend: SlurmCliBackend) -> Iterator[Callable[..., str]]:
    submitted: list[str] = []

    def _submit(*args: str) -> str:
        out = _run(slurm_any, "sbatch", "--parsable", "--output=/dev/null", *args).strip()
        job_id = out.split(";")[0]
        submitted.append(job_id)
        return job_id

    yield _submit
    for job_id in submitted:
        try:
            if backend.job_state(job_id).state not in TERMINAL:
                backend.cancel_job(job_id)
        except BackendError:
            pass


class RecordingRunner:
    """Wraps a runner and records every argv it is asked to run."""

    def __init__(self, inner: LocalRunner) -> None:
        self.inner = inner
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append(tuple(argv))
        return self.inner(argv, timeout)


# --------------------------------------------------------------------------- tests
def test_backend_implements_protocol(backend: SlurmCliBackend) -> None:
    assert isinstance(backend, SchedulerBackend)


def test_drain_with_reason_then_resume(backend: SlurmCliBackend) -> None:
    reason = "trainmedic: xid 79 on GPU 3; fell off bus (test)"
    backend.drain_node("gpu03", reason)
    state = backend.node_state("gpu03")
    assert state.drained
    assert "DRAIN" in state.flags
    assert state.reason == reason
    assert state.partitions == ("gpu",)

    backend.resume_node("gpu03")
    state = backend.node_state("gpu03")
    assert not state.drained
    assert state.state == "IDLE"


def test_requeue_excludes_drained_node(backend: SlurmCliBackend, submit: Callable[..., str]) -> None:
    job = submit("--nodes=3-4", "--requeue", "--wrap", "sleep 600")

    def running_on_4() -> bool:
        js = backend.job_state(job)
        return js.state == "RUNNING" and len(js.nodes) == 4

    _wait_for("job RUNNING on 4 nodes", running_on_4, timeout=30)
    assert set(backend.job_state(job).nodes) == set(NODES)

    backend.drain_node("gpu02", "trainmedic test: bad GPU")
    t0 = time.monotonic()
    backend.requeue_job(job, ["gpu02"])

    def running_again() -> bool:
        js = backend.job_state(job)
        return js.state == "RUNNING" and js.restart_count >= 1

    _wait_for("requeued job RUNNING again", running_again, timeout=40)
    elapsed = time.monotonic() - t0
    print(f"\n[slurm] requeue with exclusion -> RUNNING again after {elapsed:.2f}s")

    js = backend.job_state(job)
    assert "gpu02" not in js.nodes
    assert len(js.nodes) == 3
    assert "gpu02" in js.excluded_nodes
    assert js.restart_count >= 1
    assert js.partition == "gpu"
    assert js.name == "wrap"


def test_requeue_exclusion_applies_to_healthy_node(backend: SlurmCliBackend, submit: Callable[..., str]) -> None:
    """Without a drain, only ExcNodeList keeps the job off the node."""
    job = submit("--nodes=3-4", "--requeue", "--wrap", "sleep 600")
    _wait_for("job RUNNING", lambda: len(backend.job_state(job).nodes) == 4, timeout=30)
    backend.requeue_job(job, ["gpu03"])

    def running_again() -> bool:
        js = backend.job_state(job)
        return js.state == "RUNNING" and js.restart_count >= 1

    _wait_for("requeued job RUNNING again", running_again, timeout=40)
    js = backend.job_state(job)
    assert sorted(js.nodes) == ["gpu01", "gpu02", "gpu04"]
    assert js.excluded_nodes == ("gpu03",)
    assert backend.node_state("gpu03").state == "IDLE"


def test_hold_release_and_cancel(backend: SlurmCliBackend, submit: Callable[..., str]) -> None:
    job = submit("--hold", "--wrap", "sleep 600")
    js = backend.job_state(job)
    assert js.state == "PENDING"
    backend.release_job(job)
    _wait_for("job RUNNING", lambda: backend.job_state(job).state == "RUNNING", 30)
    backend.cancel_job(job)
    _wait_for("job CANCELLED", lambda: backend.job_state(job).state == "CANCELLED", 30)


def test_shell_metacharacters_in_node_name_never_run(slurm_any: Cluster, tmp_path: Path) -> None:
    runner = RecordingRunner(slurm_any.runner())
    backend = SlurmCliBackend(runner)
    pwned = tmp_path / "pwned"
    for bad in (
        "gpu01;touch /tmp/pwned",
        f"gpu01;touch {pwned}",
        "gpu01$(id)",
        "-gpu01",
    ):
        with pytest.raises(ValueError, match="invalid node name"):
            backend.drain_node(bad, "x")
        with pytest.raises(ValueError, match="invalid node name"):
            backend.resume_node(bad)
        with pytest.raises(ValueError, match="invalid node name"):
            backend.node_state(bad)
        with pytest.raises(ValueError, match="invalid node name"):
            backend.requeue_job("1", [bad])
    with pytest.raises(ValueError, match="invalid node name"):
        backend.drain_node("gpu01\n", "x")  # `$` would match before a trailing \n
    with pytest.raises(ValueError, match="invalid reason"):
        backend.drain_node("gpu01", "bad\nreason")
    with pytest.raises(ValueError, match="invalid job id"):
        backend.cancel_job("1;touch /tmp/pwned")
    assert runner.calls == []
    assert not pwned.exists()
    assert backend.node_state("gpu01").state == "IDLE"


def test_cancel_nonexistent_job_raises(backend: SlurmCliBackend) -> None:
    with pytest.raises(BackendError, match="999999999"):
        backend.cancel_job("999999999")


def test_unknown_node_raises(backend: SlurmCliBackend) -> None:
    with pytest.raises(BackendError, match="nosuch"):
        backend.node_state("nosuch")
    with pytest.raises(BackendError, match="scontrol update NodeName=nosuch"):
        backend.resume_node("nosuch")


def test_requeue_of_a_held_pending_job_only_narrows_its_nodes(
    backend: SlurmCliBackend, submit: Callable[..., str]
) -> None:
    """A held job is PENDING: ExcNodeList is updated in place, the hold is kept, nothing restarts."""
    job = submit("--hold", "--nodes=3", "--wrap", "sleep 600")
    backend.requeue_job(job, ["gpu01"])
    js = backend.job_state(job)
    assert js.state == "PENDING" and js.held
    assert js.excluded_nodes == ("gpu01",) and js.restart_count == 0
    backend.release_job(job)
    _wait_for("job RUNNING", lambda: backend.job_state(job).state == "RUNNING", 30)
    js = backend.job_state(job)
    assert sorted(js.nodes) == ["gpu02", "gpu03", "gpu04"]
