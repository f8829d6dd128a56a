"""`trainmedic diagnose --json` on cases of the labeled corpus of real logs (tests/fixtures/corpus/).

Runs the real CLI in a subprocess, as an operator would, and checks the JSON shape, the
vocabularies and the diagnosis against each case's label.yaml.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from schemas.vocab import ACTIONS, CATEGORIES, Role, Source
from tests.conftest import FIXTURES

REPO = Path(__file__).resolve().parents[2]
CORPUS = FIXTURES / "corpus" / "dev"
TOP_KEYS = {"category", "culprit", "culprit_rank", "action", "confidence", "explanation", "evidence", "files"}
EVIDENCE_KEYS = {"source", "signature", "node", "rank", "role", "line"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmedic.cli", "diagnose", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def case_files(case: str) -> list[str]:
    return [str(p) for p in sorted((CORPUS / case).iterdir()) if p.name != "label.yaml"]


def diagnose(case: str) -> dict[str, Any]:
    proc = run_cli("--json", *case_files(case))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert isinstance(report, dict)
    return report


def label(case: str) -> dict[str, Any]:
    data = yaml.safe_load((CORPUS / case / "label.yaml").read_text())
    assert isinstance(data, dict)
    return data


def assert_shape(report: dict[str, Any]) -> None:
    assert set(report) == TOP_KEYS
    assert report["category"] in CATEGORIES
    assert report["action"] in ACTIONS
    assert report["culprit"] is None or isinstance(report["culprit"], str)
    assert report["culprit_rank"] is None or isinstance(report["culprit_rank"], int)
    assert isinstance(report["confidence"], float) and 0.0 <= report["confidence"] <= 1.0
    assert isinstance(report["explanation"], str) and report["explanation"]
    assert isinstance(report["evidence"], list)
    for e in report["evidence"]:
        assert set(e) == EVIDENCE_KEYS
        assert e["source"] in get_args(Source) and e["role"] in get_args(Role)
        assert isinstance(e["signature"], str) and isinstance(e["line"], str)
    assert all(isinstance(f, str) for f in report["files"])


# One case per category: the labeled diagnosis must come out of the CLI.
CASES = [
    "healthy_megatron_gpt2_345m",
    "gpu_xid48_dbe_nccl_timeouts",
    "ic_ib_port_error_flapping_link",
    "ic_nccl_watchdog_timeout_only",
    "hang_heartbeat_monitor_deim",
    "user_attributeerror_sampler",
    "oom_slurm_step_task",
    "num_megatron_grad_norm_nan",
    "storage_enospc_checkpoint_save",
    "node_failure_during_validation",
]


@pytest.mark.parametrize("case", CASES)
def test_cli_json_matches_label(case: str) -> None:
    report = diagnose(case)
    assert_shape(report)
    want = label(case)
    assert (report["category"], report["culprit"], report["action"]) == (
        want["category"],
        want["culprit"],
        want["action"],
    )
    if want["category"] != "healthy":
        assert report["evidence"], "a fault needs evidence"


def test_healthy_run_full_of_noise_is_healthy() -> None:
    # NCCL INFO/WARN init noise, deprecation UserWarnings, fp16 "skipped iterations" and
    # "number of nan iterations:   0" on every Megatron line.
    for case in ("healthy_megatron_gpt2_345m", "healthy_nccl_socket_init", "healthy_deepspeed_overflow_recovers"):
        report = diagnose(case)
        assert_shape(report)
        assert (report["category"], report["action"], report["culprit"], report["evidence"]) == (
            "healthy",
            "none",
            None,
            [],
        )


def test_xid_kernel_log_beats_nccl_timeouts() -> None:
    # Real Xid 79 kernel log (gpu01) next to real NCCL watchdog timeouts of the other ranks.
    report = diagnose("gpu_xid79_nccl_timeouts")
    assert_shape(report)
    assert (report["category"], report["culprit"], report["action"]) == ("gpu_hardware", "gpu01", "drain_and_requeue")
    top = report["evidence"][0]
    assert (top["source"], top["signature"], top["node"], top["role"]) == ("kernel", "xid_79", "gpu01", "root")
    collateral = [e for e in report["evidence"] if e["signature"] == "nccl_watchdog_timeout"]
    assert collateral and all(e["role"] == "collateral" and e["source"] == "job_log" for e in collateral)
    assert sorted(e["rank"] for e in collateral) == [0, 3, 4]
    assert report["confidence"] >= 0.9


def test_python_exception_is_user_code_not_collateral() -> None:
    report = diagnose("user_valueerror_bad_config")
    assert (report["category"], report["action"]) == ("user_code", "stop")
    assert report["evidence"][0]["signature"] == "python_exception"


def test_human_output_and_missing_file() -> None:
    proc = run_cli(*case_files("node_failure_after_cuda_error"))
    assert proc.returncode == 0, proc.stderr
    assert "category    node" in proc.stdout and "culprit     gpu03" in proc.stdout
    missing = run_cli("--json", str(CORPUS / "no_such_case" / "job.out"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
