"""Least privilege, on the REAL Slurm clusters with accounting (MariaDB + slurmdbd, Slurm
users tmexec/tmop/tmuser: infra/slurm/start.sh for 22.05, start-2411.sh for 24.11).

The executor runs as a non-root Slurm user: on 22.05 its slurm-cli backend's
commands run here under ``runuser -u USER --`` (munge vouches for any local
user); on 24.11 the slurm-ssh backend logs in to the login node as that user.
What each AdminLevel may do, as slurmctld 22.05 and 24.11 decide it:

- tmexec, AdminLevel=Administrator: drains (UPDATE_NODE is allowed only to
  root, SlurmUser and Administrator), requeues with exclusion and cancels a job
  of another user - the executor's whole job.
- tmop, AdminLevel=Operator: requeues with exclusion and cancels another
  user's job, but is refused a drain.
- tmuser, no AdminLevel: refused a drain and any action on another user's job.

A refusal is a NotPermitted naming the command and the rights it needs, and
changes nothing.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest

from schemas.events import Action
from sinks.backends.base import NotPermitted
from sinks.backends.slurm_cli import SlurmCliBackend
from sinks.backends.slurm_ssh import slurm_ssh_backend
from sinks.executor import Executor, ExecutorSettings
from slurmio.runners import LocalRunner
from tests.conftest import Cluster, wait_for

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
JOB_OWNER = "tmuser"


class AsUser:
    """A slurmio runner that runs each Slurm command as a local (non-root) user."""

    def __init__(self, user: str, inner: LocalRunner) -> None:
        self.user, self.inner = user, inner

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        return self.inner(["runuser", "-u", self.user, "--", *argv], timeout)


def _sh(cluster: Cluster, *argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=cluster.env(), timeout=30, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@dataclass
class Site:
    """One cluster and how to act on it as a given user."""

    cluster: Cluster
    as_user: Callable[[str], SlurmCliBackend]  # the executor's backend, running as that user
    root: SlurmCliBackend

    def running_job(self, owner: str = JOB_OWNER) -> tuple[str, str]:
        """A requeueable one-node job of `owner`, RUNNING: its id and node."""
        argv = ["sbatch", "--parsable", "--requeue", "--output=/dev/null", "--chdir=/tmp"]
        argv += ["--job-name=tm-operator", "--wrap", "sleep 600"]
        submitter = self.root if owner == "root" else self.as_user(owner)
        job = submitter._raw(argv).strip().split(";")[0]
        state = wait_for(
            "the job RUNNING", lambda: (s := self.root.job_state(job)).state == "RUNNING" and s, timeout=30
        )
        return job, state.nodes[0]


@pytest.fixture(params=("22.05", "24.11"))
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    opened: list[SlurmCliBackend] = []
    if request.param == "22.05":
        cluster: Cluster = request.getfixturevalue("slurm_cluster")

        def as_user(user: str) -> SlurmCliBackend:
            return SlurmCliBackend(AsUser(user, cluster.runner()))
    else:
        cluster = request.getfixturevalue("slurm2411_cluster")
        login = cluster.login
        assert login is not None

        def as_user(user: str) -> SlurmCliBackend:
            backend = slurm_ssh_backend(
                login.host, login.port, user, login.key, login.known_hosts, slurm_conf=cluster.slurm_conf
            )
            opened.append(backend)
            return backend

    root = SlurmCliBackend(cluster.runner())

    def reset() -> None:
        _sh(cluster, "scancel", "--user", JOB_OWNER)
        _sh(cluster, "scancel", "--user", "root")
        for n in NODES:
            if root.node_state(n).drained:
                root.resume_node(n)
        wait_for(
            "all nodes idle",
            lambda: all((s := root.node_state(n)).state == "IDLE" and not s.flags for n in NODES),
            timeout=60,
        )

    levels = _sh(cluster, "sacctmgr", "-n", "-P", "show", "user", "format=user,adminlevel")
    assert {"tmexec|Administrator", "tmop|Operator", "tmuser|None"} <= set(levels.split()), levels
    reset()
    yield Site(cluster, as_user, root)
    reset()
    for b in opened:
        b.close()  # type: ignore[attr-defined]


def _action(job: str, node: str, kind: str) -> Action:
    now = time.time()
    return Action(
        event_id=f"act-op-{job}-{kind}",
        event_time=now,
        action_id=f"act-op-{job}-{kind}",
        decision_id=f"dec-op-{job}",
        incident_id="inc-00000000000000000042",
        job_id=job,
        node=node,
        partition="gpu",
        action=kind,  # type: ignore[arg-type]
        reason="trainmedic inc-00000000000000000042: gpu_hardware",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now,
    )


def test_executor_as_administrator_drains_requeues_excluding_and_cancels_another_users_job(site: Site) -> None:
    job, node = site.running_job()
    backend = site.as_user("tmexec")
    executor = Executor(backend, ExecutorSettings(verify_timeout_s=60))
    calls: list[str] = []
    result = executor.execute(_action(job, node, "drain_and_requeue"), lambda a, call: calls.append(call))
    assert result.status == "done", result
    assert calls == ["drain", "requeue"]
    state = backend.node_state(node)
    assert state.drained and state.reason == "trainmedic inc-00000000000000000042: gpu_hardware"
    assert state.reason_user == "tmexec"  # Slurm records who drained it
    after = backend.job_state(job)
    assert after.state == "RUNNING" and node not in after.nodes and node in after.excluded_nodes

    stop = executor.execute(_action(job, node, "stop"), lambda a, call: calls.append(call))
    assert stop.status == "done", stop
    assert backend.job_state(job).state == "CANCELLED"
    backend.resume_node(node)
    assert not backend.node_state(node).drained


def test_operator_requeues_and_cancels_another_users_job_but_may_not_drain(site: Site) -> None:
    job, node = site.running_job()
    backend = site.as_user("tmop")
    with pytest.raises(NotPermitted, match=r"scontrol update NodeName=.*Invalid user id.*AdminLevel=Administrator"):
        backend.drain_node(node, "trainmedic inc-00000000000000000042: gpu_hardware")
    assert not backend.node_state(node).drained  # nothing changed

    backend.requeue_job(job, [node])
    wait_for(
        "the job RUNNING again off the excluded node",
        lambda: (s := backend.job_state(job)).state == "RUNNING" and node not in s.nodes and node in s.excluded_nodes,
        timeout=60,
    )
    backend.cancel_job(job)
    wait_for("the job CANCELLED", lambda: backend.job_state(job).state == "CANCELLED", timeout=30)


def test_plain_user_is_refused_and_nothing_changes(site: Site) -> None:
    job, node = site.running_job(owner="root")
    root = site.root
    before = root.job_state(job)
    backend = site.as_user("tmuser")
    with pytest.raises(NotPermitted, match=r"Invalid user id.*AdminLevel=Administrator"):
        backend.drain_node(node, "trainmedic inc-00000000000000000042: gpu_hardware")
    with pytest.raises(NotPermitted, match=r"scontrol requeuehold"):
        backend.requeue_job(job, [node])
    with pytest.raises(NotPermitted, match=r"scancel"):
        backend.cancel_job(job)
    assert not root.node_state(node).drained
    now = root.job_state(job)
    assert (now.state, now.restart_count, now.excluded_nodes) == ("RUNNING", before.restart_count, ())
