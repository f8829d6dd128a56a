"""The Slurm 24.11 cluster of infra/slurm/start-2411.sh, and what only it can show.

The executor's, producer's and discovery's own tests run on both clusters
(``slurm_any``); this module checks the 24.11 setup itself (a real 24.11, the
wrappers, the private mount namespace, idempotent start) and the SSH backend
against the 24.11 login node (sshd inside the trixie root), verified through
the local 24.11 CLI.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sinks.backends.slurm_cli import SlurmCliBackend
from sinks.backends.slurm_ssh import SlurmSshBackend, SshHostKeyError, slurm_ssh_backend
from slurmio.scontrol import show_job
from slurmio.sinfo import read_sinfo
from slurmio.squeue import read_jobs
from slurmio.versions import known_versions
from tests.conftest import START_2411, Cluster, wait_for

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
REPO = Path(__file__).resolve().parents[2]


def _sh(cluster: Cluster, *argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=cluster.env(), timeout=30, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@pytest.fixture
def local(slurm2411_cluster: Cluster) -> Iterator[SlurmCliBackend]:
    """The 24.11 cluster read without SSH: the independent witness; clean before and after."""
    backend = SlurmCliBackend(slurm2411_cluster.runner())

    def reset() -> None:
        _sh(slurm2411_cluster, "scancel", "--user", "root")
        for node in NODES:
            state = backend.node_state(node)
            if state.drained or state.state == "DOWN":
                backend.resume_node(node)
        wait_for(
            "all 24.11 nodes idle",
            lambda: all((s := backend.node_state(n)).state == "IDLE" and not s.flags for n in NODES),
            timeout=60,
        )

    reset()
    yield backend
    reset()


@pytest.fixture
def ssh_2411(slurm2411_cluster: Cluster) -> Iterator[SlurmSshBackend]:
    login = slurm2411_cluster.login
    assert login is not None
    backend = slurm_ssh_backend(
        login.host, login.port, login.user, login.key, login.known_hosts, slurm_conf=slurm2411_cluster.slurm_conf
    )
    yield backend
    backend.close()


# ----------------------------------------------------------------- the cluster itself
def test_it_is_a_real_2411_speaking_data_parser_v0042(slurm2411_cluster: Cluster) -> None:
    assert _sh(slurm2411_cluster, "sinfo", "-V").strip() == "slurm-wlm 24.11.5"
    assert _sh(slurm2411_cluster, "scontrol", "ping").count("is UP") == 1
    nodes = read_sinfo(_sh(slurm2411_cluster, "sinfo", "--json"))
    assert nodes.parser.version == "v0.0.42" and nodes.parser.release == "24.11.5"
    assert sorted(nodes.nodes) == list(NODES)


def test_live_documents_of_both_clusters_name_their_parser(slurm_any: Cluster) -> None:
    expected = {"22.05": "v0.0.38", "24.11": "v0.0.42"}[slurm_any.version]
    jobs = read_jobs(_sh(slurm_any, "squeue", "--json", "--states=all"))
    nodes = read_sinfo(_sh(slurm_any, "sinfo", "--json"))
    assert jobs.parser.version == nodes.parser.version == expected
    assert known_versions()[expected].scontrol_json is (slurm_any.version == "24.11")


def test_start_is_idempotent_and_mounts_stay_private(slurm2411_cluster: Cluster) -> None:
    run = slurm2411_cluster.state_dir / "data" / "run"
    pids = {p.name: p.read_text().strip() for p in run.glob("*.pid")}
    assert {"holder.pid", "slurmctld.pid", "sshd.pid", "slurmdbd.pid"} <= set(pids)
    assert len(set(pids) - {"slurmrestd.pid"}) == 8  # + mariadb, munged, 4 slurmd
    proc = subprocess.run(["bash", str(START_2411)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "already up" in proc.stdout
    assert {p.name: p.read_text().strip() for p in run.glob("*.pid")} == pids  # nothing restarted
    # The bind mounts of /proc, /dev, /sys and /tmp exist only in the holder's namespace.
    root = str(slurm2411_cluster.state_dir / "root")
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if f" {root}/" in line]
    holder = pids["holder.pid"]
    theirs = Path(f"/proc/{holder}/mounts").read_text()
    assert f" {root}/proc " in theirs and f" {root}/tmp " in theirs


def test_scontrol_json_and_text_agree_on_a_live_job(
    slurm2411_cluster: Cluster, local: SlurmCliBackend, tmp_path: Path
) -> None:
    out = tmp_path / "agree-%j.out"
    job = _sh(
        slurm2411_cluster,
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--ntasks=4",
        f"--output={out}",
        "--comment=two words",
        "--wrap",
        "sleep 600",
    ).strip()
    runner = slurm2411_cluster.runner()
    wait_for("job RUNNING", lambda: local.job_state(job).state == "RUNNING", timeout=30)
    as_json = show_job(runner, job, 30, known_versions()["v0.0.42"])
    as_text = show_job(runner, job, 30, known_versions()["v0.0.38"])  # the -o text form
    assert as_json is not None and as_text is not None
    assert as_json.std_out == as_text.std_out == str(tmp_path / f"agree-{job}.out")
    assert (
        (as_json.nodes, as_json.tasks, as_json.comment, as_json.state)
        == (
            as_text.nodes,
            as_text.tasks,
            as_text.comment,
            as_text.state,
        )
        == (as_json.nodes, 4, "two words", "RUNNING")
    )
    assert show_job(runner, "999999", 30, known_versions()["v0.0.42"]) is None


# ----------------------------------------------------------------- SSH to the 24.11 login node
def test_login_node_runs_2411(ssh_2411: SlurmSshBackend) -> None:
    assert ssh_2411.runner(["sinfo", "-V"], 30).strip() == "slurm-wlm 24.11.5"


def test_drain_and_requeue_with_exclusion_over_ssh_on_2411(
    slurm2411_cluster: Cluster, ssh_2411: SlurmSshBackend, local: SlurmCliBackend
) -> None:
    out = ssh_2411.runner(
        ["sbatch", "--parsable", "--nodes=3-4", "--requeue", "--output=/dev/null", "--wrap", "sleep 600"], 30
    )
    job = out.strip().split(";")[0]
    assert local.job_state(job).name == "wrap"

    def running_on_4() -> bool:
        js = ssh_2411.job_state(job)
        return js.state == "RUNNING" and len(js.nodes) == 4

    wait_for(f"job {job} RUNNING on 4 nodes", running_on_4, timeout=60)
    reason = "trainmedic test: xid 79 on GPU 3 (ssh, 24.11)"
    ssh_2411.drain_node("gpu02", reason)
    t0 = time.monotonic()
    ssh_2411.requeue_job(job, ["gpu02"])

    def running_again() -> bool:
        js = ssh_2411.job_state(job)
        return js.state == "RUNNING" and js.restart_count >= 1

    wait_for("requeued job RUNNING again", running_again, timeout=60)
    print(f"\n[slurm 24.11] requeue with exclusion over SSH -> RUNNING again after {time.monotonic() - t0:.2f}s")
    node = local.node_state("gpu02")
    assert node.drained and node.reason == reason
    js = local.job_state(job)
    assert js.state == "RUNNING" and "gpu02" not in js.nodes and len(js.nodes) == 3
    assert js.excluded_nodes == ("gpu02",) and js.restart_count >= 1
    assert ssh_2411.runner.connections_opened == 1


def test_wrong_host_key_of_the_2411_login_node_runs_nothing(
    slurm2411_cluster: Cluster, local: SlurmCliBackend, tmp_path: Path
) -> None:
    login = slurm2411_cluster.login
    assert login is not None
    known = tmp_path / "known_hosts"
    # The 22.05-side test keys are not this node's: a stale known_hosts entry.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, blob = (tmp_path / "other.pub").read_text().split()[:2]
    known.write_text(f"[{login.host}]:{login.port} {kind} {blob}\n")
    backend = slurm_ssh_backend(login.host, login.port, login.user, login.key, known)
    try:
        with pytest.raises(SshHostKeyError, match="nothing was run"):
            backend.drain_node("gpu01", "must never be applied")
    finally:
        backend.close()
    assert not local.node_state("gpu01").drained
