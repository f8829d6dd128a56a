"""`trainmedic diagnose --job ID` on the real clusters (22.05 and 24.11, slurm_any).

A 2-node job runs `srun --label` with one task per node; task 1 prints a real CUDA/NCCL
error text (tests/fixtures/corpus/dev/gpu_cuda_ecc_nccl_watchdog/job.out, from
https://github.com/kohya-ss/sd-scripts/issues/1434, cited in its label.yaml), so Slurm itself
writes the rank prefixes ("1: ..."). diagnose reads the job's StdOut and node list from
Slurm and must resolve rank 1 to the job's second node, while the job runs and after it ended.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
TRAINMEDIC = REPO / ".venv" / "bin" / "trainmedic"
FIXTURE = REPO / "tests" / "fixtures" / "corpus" / "dev" / "gpu_cuda_ecc_nccl_watchdog" / "job.out"
GONE = ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL")


def _diagnose(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TRAINMEDIC), "diagnose", "--slurm-conf", cluster.slurm_conf, *args],
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=120,
        check=False,
    )


def _report(cluster: Cluster, job: str) -> dict[str, Any]:
    proc = _diagnose(cluster, "--json", "--job", job)
    assert proc.returncode == 1, proc.stderr  # a fault was found
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.fixture
def jobs(slurm_any: Cluster) -> Iterator[list[str]]:
    submitted: list[str] = []
    yield submitted
    cli = SlurmCliBackend(slurm_any.runner())
    for job in submitted:
        if cli.job_state(job).state not in GONE:
            cli.cancel_job(job)


def _sbatch(cluster: Cluster, jobs: list[str], *args: str) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", *args], capture_output=True, text=True, env=cluster.env(), timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    jobs.append(job)
    return job


def test_job_output_diagnosed_with_its_nodes_running_and_finished(
    slurm_any: Cluster, jobs: list[str], tmp_path: Path
) -> None:
    # tmp_path is under /tmp, which the 24.11 root sees at the same path.
    tmp_path.chmod(0o755)
    text = tmp_path / "rank1.txt"
    shutil.copy(FIXTURE, text)
    out = tmp_path / "train-%j.out"
    job = _sbatch(
        slurm_any,
        jobs,
        "-N2",
        "--ntasks-per-node=1",
        f"--output={out}",
        "--wrap",
        f"srun --label bash -c 'if [ $SLURM_PROCID = 1 ]; then cat {text}; fi'; sleep 300",
    )
    cli = SlurmCliBackend(slurm_any.runner())
    wait_for(f"job {job} RUNNING", lambda: cli.job_state(job).state == "RUNNING", timeout=60)
    nodes = cli.job_state(job).nodes
    assert len(nodes) == 2
    log = tmp_path / f"train-{job}.out"
    wait_for("task 1's lines in the job's output", lambda: log.exists() and "1: " in log.read_text(), timeout=60)

    running = _report(slurm_any, job)
    assert running["job"]["state"] == "RUNNING" and tuple(running["job"]["nodes"]) == nodes
    assert running["job"]["paths"] == [str(log)] and running["job"]["ranks_per_node"] == 1
    assert (running["category"], running["action"], running["culprit_rank"]) == ("gpu_hardware", "drain_and_requeue", 1)
    # Rank 1 of a block placement with one task per node: the job's second node.
    assert running["culprit_node_resolved"] == nodes[1]

    cli.cancel_job(job)
    wait_for(f"job {job} ended", lambda: cli.job_state(job).state in GONE, timeout=60)
    finished = _report(slurm_any, job)  # still known to slurmctld (MinJobAge=600)
    assert finished["job"]["state"] == "CANCELLED"
    assert finished["culprit_node_resolved"] == nodes[1]

    text_out = _diagnose(slurm_any, "--job", job)
    assert text_out.returncode == 1
    assert f"job         {job} (CANCELLED)" in text_out.stdout and nodes[1] in text_out.stdout


def test_unknown_job_unreadable_output_and_bad_options_are_refused(
    slurm_any: Cluster, jobs: list[str], tmp_path: Path
) -> None:
    proc = _diagnose(slurm_any, "--job", "987654321")
    assert proc.returncode == 2 and "not known to slurmctld" in proc.stderr, proc.stderr

    tmp_path.chmod(0o755)
    out = tmp_path / "gone.out"
    job = _sbatch(slurm_any, jobs, "-N1", f"--output={out}", "--wrap", "echo hello")
    cli = SlurmCliBackend(slurm_any.runner())
    wait_for(f"job {job} ended", lambda: cli.job_state(job).state in GONE, timeout=60)
    out.unlink()
    proc = _diagnose(slurm_any, "--job", job)
    assert proc.returncode == 2 and f"cannot read its output {out} (no such file)" in proc.stderr, proc.stderr

    quiet = _sbatch(slurm_any, jobs, "-N1", "--output=/dev/null", "--error=/dev/null", "--wrap", "true")
    proc = _diagnose(slurm_any, "--job", quiet)
    assert proc.returncode == 2 and "has no output file" in proc.stderr, proc.stderr

    for args, needle in [
        (("--job", job, "--nodelist", "gpu01"), "takes the node list from Slurm"),
        (("--job", "12a"), "digits only"),
        ((), "give log PATHS, or --job ID"),
    ]:
        proc = _diagnose(slurm_any, *args)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
