"""SIGKILL the executor after its scheduler call and before its offset commit, on the
real Slurm: after a restart the node is drained once, the job requeued once, and
exactly one result is published."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.publish import Publisher
from schemas.codec import decode
from schemas.events import Action, ActionResult
from schemas.topics import ACTION_RESULTS, ACTIONS
from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, read_topic, slurm_cmd, wait_for
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm


def _executor(bootstrap: str, cluster: Cluster, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SLURM_CONF=cluster.slurm_conf)
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainmedic.cli.main",
                "run",
                "executor",
                "--bootstrap",
                bootstrap,
                "--group",
                "crash-test",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _results(bootstrap: str, seconds: float) -> list[ActionResult]:
    return [decode(ActionResult, v) for v in read_topic(bootstrap, ACTION_RESULTS.name, seconds)]


def test_sigkill_between_act_and_commit_acts_once(
    slurm_cluster: Cluster, slurm: SlurmCliBackend, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    job = (
        slurm_cmd(
            slurm_cluster,
            "sbatch",
            "--parsable",
            "--nodes=3-4",
            "--requeue",
            "--output=/dev/null",
            "--wrap",
            "sleep 600",
        )
        .strip()
        .split(";")[0]
    )
    wait_for(
        "job RUNNING on 4 nodes",
        lambda: slurm.job_state(job).state == "RUNNING" and len(slurm.job_state(job).nodes) == 4,
    )
    incident = f"inc-crash{time.monotonic_ns()}"
    log = tmp_path / "executor.log"
    first = _executor(broker.bootstrap, slurm_cluster, log)
    try:
        wait_for("the executor to start", lambda: "executor up" in log.read_text())
        pub = Publisher(broker.bootstrap, "test")
        pub.publish(
            ACTIONS,
            Action(
                event_id=f"act-{incident}",
                event_time=time.time(),
                action_id=f"act-{incident}",
                decision_id="dec-x",
                incident_id=incident,
                job_id=job,
                node="gpu02",
                partition="gpu",
                action="drain_and_requeue",
                reason=f"trainmedic {incident}: gpu_hardware",
                requested_by="policy",
                incident_time=time.time(),
                first_signal_time=time.time(),
            ),
        )
        assert pub.flush(10) == 0
        # The drain is the first scheduler call; the offset is committed only after the
        # requeue is verified (several seconds later on Slurm): kill in between.
        wait_for(
            "gpu02 drained by the executor",
            lambda: incident in (slurm.node_state("gpu02").reason or ""),
            timeout=60,
            interval=0.05,
        )
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    assert _results(broker.bootstrap, 1.0) == [], "the killed executor must not have published a result"
    second = _executor(broker.bootstrap, slurm_cluster, log)
    try:
        results = wait_for("the result after the restart", lambda: _results(broker.bootstrap, 2.0), timeout=120)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    more = _results(broker.bootstrap, 3.0)
    assert len(results) == 1 and len(more) == 1, (results, more)
    assert results[0].status == "done", results[0]
    assert any("already drained" in s for s in results[0].steps)
    state = slurm.job_state(job)
    assert state.state == "RUNNING" and "gpu02" not in state.nodes and state.restart_count == 1
    ctld_log = (slurm_cluster.state_dir / "log" / "slurmctld.log").read_text()
    assert sum(1 for line in ctld_log.splitlines() if f"reason set to: trainmedic {incident}" in line) == 1


def test_drain_of_a_node_outside_the_job_is_refused_on_slurm(slurm_cluster: Cluster, slurm: SlurmCliBackend) -> None:
    """The job runs on gpu01-02 and its output named gpu04: the executor reads the job's nodes from
    Slurm (squeue) and refuses the drain; gpu04 stays in service. The node's own report drains it."""
    from sinks.executor import Executor, ExecutorSettings, Refused

    job = (
        slurm_cmd(
            slurm_cluster, "sbatch", "--parsable", "-w", "gpu01,gpu02", "--output=/dev/null", "--wrap", "sleep 600"
        )
        .strip()
        .split(";")[0]
    )
    wait_for("job RUNNING on gpu01-02", lambda: slurm.job_state(job).nodes == ("gpu01", "gpu02"))
    now = time.time()
    action = Action(
        event_id="act-foreign-slurm",
        event_time=now,
        action_id="act-foreign-slurm",
        decision_id="dec-foreign-slurm",
        incident_id="inc-foreign-slurm",
        job_id=job,
        node="gpu04",
        partition="gpu",
        action="drain_and_requeue",
        reason="trainmedic inc-foreign-slurm: node",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now,
    )
    calls: list[str] = []
    executor = Executor(slurm, ExecutorSettings(verify_timeout_s=30))
    with pytest.raises(Refused) as refused:
        executor.execute(action, lambda a, call: calls.append(call))
    assert refused.value.guardrail == "culprit_not_in_job" and "gpu01,gpu02" in refused.value.detail
    assert calls == [] and not slurm.node_state("gpu04").drained
    assert slurm.job_state(job).state == "RUNNING" and slurm.job_state(job).restart_count == 0
    # A job Slurm does not know (purged, or a forged id): its nodes cannot be read, so no drain.
    with pytest.raises(Refused, match="cannot be read"):
        executor.execute(action.model_copy(update={"job_id": "999999"}), lambda a, call: calls.append(call))
    assert calls == [] and not slurm.node_state("gpu04").drained
