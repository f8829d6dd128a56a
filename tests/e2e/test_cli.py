"""The README's commands as an operator runs them: real processes, real output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from trainmedic.stack.broker import free_port, port_in_use

TRAINMEDIC = [sys.executable, "-m", "trainmedic.cli.main"]


def test_demo_json_names_the_injected_culprit(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*TRAINMEDIC, "demo", "--json", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["incident"]["culprit"] == report["injected"]["node"]
    assert report["incident"]["category"] == "gpu_hardware"
    assert report["decision"] == report["decision"] | {"action": "drain_and_requeue", "kind": "action"}
    assert report["action_result"]["status"] == "done"
    assert report["injected"]["node"] not in report["job_after"]["nodes"]
    assert report["job_after"]["state"] == "RUNNING"
    assert report["healthy_job"]["incidents"] == 0
    assert report["incidents_per_job"] == {report["injected"]["job_id"]: 1}
    # The demo's audit outlives it: explain the incident under the policy in force (a dry run).
    explain = subprocess.run(
        [
            *TRAINMEDIC,
            "policy",
            "explain",
            "--incident",
            report["incident"]["incident_id"],
            "--data-dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert explain.returncode == 0, explain.stderr
    assert "decision: drain_and_requeue by actions.gpu_hardware=drain_and_requeue" in explain.stdout
    assert "mode: monitor" in explain.stdout and "recommendation only" in explain.stdout


def test_demo_monitor_mode_only_recommends(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*TRAINMEDIC, "demo", "--mode", "monitor", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recommendation" in proc.stdout and "the scheduler was not called" in proc.stdout
    assert "scheduler    no calls" in proc.stdout


def test_up_starts_and_ctrl_c_stops_cleanly(tmp_path: Path) -> None:
    metrics_port = free_port()
    main_metrics_port = free_port()
    log = tmp_path / "up.out"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                *TRAINMEDIC,
                "up",
                "--backend",
                "simulated",
                "--api-port",
                "0",
                "--metrics-port",
                str(metrics_port),
                "--metrics-address",
                f"127.0.0.1:{main_metrics_port}",
                "--data-dir",
                str(tmp_path),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + 120
    while "trainmedic is up" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert "trainmedic is up" in log.read_text(), log.read_text()[-3000:]
    # Prometheus metrics: the streams worker on its own port, the rest of `up` on its own listener
    # (no token, read-only); the token-only API no longer serves them.
    worker_metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert "trainmedic_detection_latency_seconds_bucket" in worker_metrics
    runtime = json.loads((tmp_path / "runtime.json").read_text())
    api_url = runtime["api_url"]
    assert runtime["metrics_url"] == f"http://127.0.0.1:{main_metrics_port}/metrics"
    main_metrics = urllib.request.urlopen(runtime["metrics_url"], timeout=10).read().decode()
    assert "trainmedic_actions_total" in main_metrics and "trainmedic_action_latency_seconds" in main_metrics
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(f"{api_url}/metrics/", timeout=10)
    assert gone.value.code == 404
    # The operator commands find the running stack through DATA_DIR/runtime.json and its token file.
    common = ["--data-dir", str(tmp_path)]
    show = subprocess.run([*TRAINMEDIC, "mode", "show", *common], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["mode"] == "monitor"
    promote = [
        *TRAINMEDIC,
        "mode",
        "set",
        "autonomous",
        "--partition",
        "canary",
        "--category",
        "gpu_hardware",
        "--reason",
        "canary first",
        "--operator",
        "alice",
        *common,
    ]
    refused = subprocess.run(promote, capture_output=True, text=True, timeout=60)
    assert (
        refused.returncode == 2 and "not ready for autonomy" in refused.stderr and "too few samples" in refused.stderr
    )
    assert not (tmp_path / "modes.yaml").exists()
    changed = subprocess.run([*promote, "--force"], capture_output=True, text=True, timeout=60)
    assert changed.returncode == 0, changed.stderr
    assert "monitor -> autonomous" in changed.stdout
    overlay = yaml.safe_load((tmp_path / "modes.yaml").read_text())
    assert overlay == {"partitions": {"canary": {"categories": {"gpu_hardware": "autonomous"}}}}
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "trainmedic stopped cleanly." in out


def _adjacent_free_ports(n: int) -> int:
    for _ in range(50):
        first = free_port()
        if first + n <= 65535 and not any(port_in_use("127.0.0.1", first + i) for i in range(1, n)):
            return first
    raise AssertionError(f"no {n} adjacent free ports")


def test_up_with_two_workers_serves_every_metrics_listener(tmp_path: Path) -> None:
    """As with the defaults (workers from 9478, `up`'s own listener 9479): the second worker's port
    would be `up`'s own, and `up --workers 2` stopped at start with "address already in use"."""
    base = _adjacent_free_ports(3)
    log = tmp_path / "up.out"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                *TRAINMEDIC,
                "up",
                "--backend",
                "simulated",
                "--api-port",
                "0",
                "--workers",
                "2",
                "--metrics-port",
                str(base),
                "--metrics-address",
                f"127.0.0.1:{base + 1}",
                "--data-dir",
                str(tmp_path),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 180
        while "trainmedic is up" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert "trainmedic is up" in log.read_text(), log.read_text()[-3000:]
        runtime = json.loads((tmp_path / "runtime.json").read_text())
        assert runtime["worker_metrics_urls"] == [
            f"http://127.0.0.1:{base}/metrics",
            f"http://127.0.0.1:{base + 2}/metrics",
        ]
        for url in runtime["worker_metrics_urls"]:
            assert (
                "trainmedic_detection_latency_seconds_bucket" in urllib.request.urlopen(url, timeout=10).read().decode()
            )
        assert "trainmedic_actions_total" in urllib.request.urlopen(runtime["metrics_url"], timeout=10).read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["up", "--mode", "sometimes"], "--mode 'sometimes'"),
        (["up", "--bootstrap", "nohost"], "TRAINMEDIC_BOOTSTRAP 'nohost': expected HOST:PORT"),
        (["up", "--policy", "/nonexistent.yaml"], "/nonexistent.yaml: cannot read policy file"),
    ],
)
def test_bad_settings_fail_fast_naming_the_setting(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = subprocess.run(
        [*TRAINMEDIC, *args, "--backend", "simulated", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert needle in proc.stderr


@pytest.mark.slurm
def test_demo_slurm_acts_on_the_real_cluster(tmp_path: Path, slurm: object) -> None:
    proc = subprocess.run(
        [*TRAINMEDIC, "demo", "--slurm", "--json", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    # On a wrong verdict the report on stdout says what was attributed instead.
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-4000:]
    report = json.loads(proc.stdout)
    assert report["scheduler"] == "slurm-cli"
    assert report["incident"]["culprit"] == report["injected"]["node"]
    assert report["action_result"]["status"] == "done", report["action_result"]
    assert report["job_after"]["state"] == "RUNNING" and report["injected"]["node"] not in report["job_after"]["nodes"]


def test_pyslurm_backend_without_pyslurm_fails_fast_with_the_install_hint(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*TRAINMEDIC, "up", "--backend", "pyslurm", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--backend pyslurm: pyslurm is not installed (pip install 'trainmedic[pyslurm]'" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused before anything started


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--backend", "slurm-ssh", "--ssh", "root@127.0.0.1", "--ssh-key", "/nonexistent/id_ed25519"], "--ssh-key"),
        (["--backend", "simulated", "--clickhouse", "http://127.0.0.1:9"], "http://127.0.0.1:9"),
        (["--backend", "simulated", "--policy", "{policy}"], "unknown category"),
    ],
)
def test_more_bad_settings_fail_fast_naming_the_setting(tmp_path: Path, args: list[str], needle: str) -> None:
    """A missing SSH key, an unreachable ClickHouse and a policy with an unknown category stop
    `up` before it starts anything, with the setting in the message."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("mode: monitor\nactions:\n  gpu_hardwre: stop\n")
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    args = [a.replace("{policy}", str(policy)) for a in args]
    if "slurm-ssh" in args:
        args += ["--known-hosts", str(known_hosts)]
    proc = subprocess.run(
        [*TRAINMEDIC, "up", *args, "--data-dir", str(tmp_path / "var")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr, proc.stderr[-2000:]
