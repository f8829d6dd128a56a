"""`trainmedic diagnose --json` on cases of the labeled corpus of real logs (tests/fixtures/corpus/).

Runs the real CLI app (the one `trainmedic` runs) and checks the JSON shape, the vocabularies and
the diagnosis against each case's label.yaml. Most calls go through typer's CliRunner in this
process: a new interpreter costs ~1.5 s of imports and catalog loading per call, ~40 calls here.
The human output and a real stdin pipe are run in a subprocess, as an operator would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from typer.testing import CliRunner

from schemas.vocab import ACTIONS, CATEGORIES, Role, Source
from tests.conftest import FIXTURES
from trainmedic.cli.main import app

REPO = Path(__file__).resolve().parents[2]
CORPUS = FIXTURES / "corpus" / "dev"
TOP_KEYS = {
    "category",
    "culprit",
    "culprit_rank",
    "culprit_node_resolved",
    "action",
    "confidence",
    "explanation",
    "evidence",
    "files",
    "provenance",
}
EVIDENCE_KEYS = {"source", "provenance", "signature", "node", "rank", "role", "line"}


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`trainmedic diagnose ARGS` in this process; an exception the CLI lets out fails the test."""
    argv = ["diagnose", *args]
    result = CliRunner().invoke(app, argv, input=stdin, catch_exceptions=False)
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def run_process(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`trainmedic diagnose ARGS` in a new interpreter, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "trainmedic.cli.main", "diagnose", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        input=stdin,
    )


def case_files(case: str) -> list[str]:
    return [str(p) for p in sorted((CORPUS / case).iterdir()) if p.name != "label.yaml"]


def diagnose(case: str) -> dict[str, Any]:
    proc = run_cli("--json", *case_files(case))
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert isinstance(report, dict)
    # Exit status: 0 healthy, 1 a fault (or a crash of unknown cause).
    assert proc.returncode == (0 if report["category"] == "healthy" else 1)
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
    proc = run_process(*case_files("node_failure_after_cuda_error"))
    assert proc.returncode == 1, proc.stderr
    assert "category    node" in proc.stdout and "culprit     gpu03" in proc.stdout
    missing = run_cli("--json", str(CORPUS / "no_such_case" / "job.out"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


# -- inputs, exit status, rank -> node, progress findings (issue 13) --------------------------

LOGS = FIXTURES / "logs"
PROGRESS = FIXTURES / "progress"


def run_json(*args: str, stdin: str | None = None, process: bool = False) -> tuple[int, dict[str, Any]]:
    proc = (run_process if process else run_cli)("--json", *args, stdin=stdin)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert_shape(report)
    return proc.returncode, report


def test_directory_is_every_file_in_it_and_dash_is_stdin(tmp_path: Path) -> None:
    case = "gpu_xid79_nccl_timeouts"
    nested = tmp_path / "logs" / "kernel"
    nested.mkdir(parents=True)
    for f in case_files(case):
        src = Path(f)
        (nested if src.name.startswith("kern") else tmp_path / "logs").joinpath(src.name).write_bytes(src.read_bytes())
    rc, by_dir = run_json(str(tmp_path / "logs"))
    rc_files, by_files = run_json(*case_files(case))
    assert rc == rc_files == 1
    assert (by_dir["category"], by_dir["culprit"], by_dir["action"]) == (
        by_files["category"],
        by_files["culprit"],
        by_files["action"],
    )
    assert len(by_dir["files"]) == len(by_files["files"])
    # A job log on stdin, next to a kernel log file.
    job = next(Path(f) for f in case_files(case) if not Path(f).name.startswith("kern"))
    kern = [f for f in case_files(case) if Path(f).name.startswith("kern")]
    rc, piped = run_json("-", *kern, stdin=job.read_text(), process=True)  # a real pipe on stdin
    assert rc == 1 and "-" in piped["files"]
    assert (piped["category"], piped["culprit"]) == (by_files["category"], by_files["culprit"])


def test_exit_status_and_bad_input() -> None:
    rc, report = run_json(*case_files("healthy_megatron_gpt2_345m"))
    assert (rc, report["category"]) == (0, "healthy")
    for args, needle in [
        ((str(CORPUS / "no_such_case"),), "no such file or directory"),
        (("--nodelist", "gpu[01-04", *case_files("healthy_megatron_gpt2_345m")), "gpu[01-04"),
        (("--nodelist", "gpu01", "--distribution", "plane", *case_files("healthy_megatron_gpt2_345m")), "plane"),
        (("--ranks-per-node", "8", *case_files("healthy_megatron_gpt2_345m")), "need a node list"),
        (("--rank-map", "/nonexistent/map", *case_files("healthy_megatron_gpt2_345m")), "cannot read the rank map"),
        (("-", "-"), "given twice"),
    ]:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert needle in proc.stderr, (args, proc.stderr)


def test_rank_culprit_resolved_to_its_node(tmp_path: Path) -> None:
    # kohya-ss/sd-scripts#1434: "[Rank 1] NCCL watchdog thread terminated with exception: CUDA error:
    # uncorrectable ECC error". The text names no host: isolation stays drain_and_requeue, naming
    # rank 1, and a node list resolves it.
    files = case_files("gpu_cuda_ecc_nccl_watchdog")
    _, plain = run_json(*files)
    assert (plain["category"], plain["action"], plain["culprit_rank"]) == ("gpu_hardware", "drain_and_requeue", 1)
    assert plain["culprit"] is None and plain["culprit_node_resolved"] is None
    assert "rank 1" in plain["explanation"]
    _, block = run_json("--nodelist", "gpu[01-04]", "--ranks-per-node", "2", *files)
    assert block["culprit_node_resolved"] == "gpu01" and block["culprit"] is None
    _, cyclic = run_json("--nodelist", "gpu[01-04]", "--distribution", "cyclic", *files)
    assert cyclic["culprit_node_resolved"] == "gpu02"
    rank_map = tmp_path / "ranks.txt"
    rank_map.write_text("0 gpu07\n1 gpu05\n")
    _, mapped = run_json("--rank-map", str(rank_map), *files)
    assert mapped["culprit_node_resolved"] == "gpu05"
    assert "rank 1 ran on gpu05" in mapped["explanation"]


def test_hang_offline_from_the_logs_own_clock_and_from_a_stack_dump() -> None:
    # BLOOM stuck at eval: progress, then 2 h of the run's own PULSE status lines and nothing else.
    rc, silent = run_json(*case_files("hang_bloom_eval_stuck_no_timeout"))
    assert (rc, silent["category"], silent["action"]) == (1, "hang", "requeue")
    assert silent["evidence"][0]["signature"] == "hang"
    # The run that ended as planned ("[exiting program after ...]") is no hang, whatever follows.
    rc, planned = run_json(*case_files("healthy_tr1_time_limit_exit_checkpoint"))
    assert (rc, planned["category"]) == (0, "healthy")
    # py-spy dump of a hung accelerate/ZeRO-3 job: a thread active in all_gather_into_tensor.
    rc, dump = run_json(str(PROGRESS / "pyspy_dump_allgather.log"))
    assert (rc, dump["category"], dump["evidence"][0]["signature"]) == (1, "hang", "hang_stack_dump")
    assert "a collective" in dump["evidence"][0]["line"]


def test_progress_findings_offline() -> None:
    # tr8-104B: the lm loss climbs 6.4 -> 10.2 and the excerpt ends at the peak: divergence, stop.
    _, diverged = run_json(*case_files("num_tr8_104b_loss_climbing_divergence"))
    assert (diverged["category"], diverged["action"]) == ("numerical", "stop")
    assert diverged["evidence"][0]["signature"] == "loss_divergence"
    # BLOOM's loss spike that recovered stays healthy.
    rc, spike = run_json(*case_files("healthy_bloom_loss_spike_recovered"))
    assert (rc, spike["category"]) == (0, "healthy")
    # DALI#2608: time per batch 0.17 s -> 8.7 s and stays, the data wait nearly all of it.
    _, slow = run_json(str(PROGRESS / "throughput_drop_data_wait.log"))
    assert (slow["category"], slow["evidence"][0]["signature"]) == ("storage", "throughput_drop")
    # deeplab-lfov: one slow checkpoint step is no finding (its loss jump recovers at once, too).
    rc, ckpt = run_json(str(PROGRESS / "checkpoint_step_dip.log"))
    assert (rc, ckpt["category"]) == (0, "healthy")


def test_crash_with_no_known_cause_is_unknown_not_healthy(tmp_path: Path) -> None:
    # A traceback that ends in no exception any catalog knows, then the launcher's non-zero exit.
    log = tmp_path / "job.out"
    frames = (LOGS / "keyboard_interrupt_traceback.log").read_text().splitlines()[:-1]
    log.write_text("\n".join([*frames, "SystemExit: 3", "srun: error: gpu01: task 0: Exited with exit code 3"]) + "\n")
    rc, report = run_json(str(log))
    assert (rc, report["category"], report["action"], report["culprit"]) == (1, "unknown", "none", None)
    assert report["evidence"][0]["signature"] in ("crash_unexplained", "error_line_unexplained", "crash_exit_code")


def test_an_interrupt_is_the_operators_decision_not_a_fault() -> None:
    # nagadomi/nunif#26: a single-process training stopped by KeyboardInterrupt (SIGINT, the
    # terminal's Ctrl-C) inside GradScaler.step, nothing else: ended by decision, no action.
    rc, report = run_json(str(LOGS / "keyboard_interrupt_traceback.log"))
    assert (rc, report["category"], report["action"]) == (0, "healthy", "none")
    assert "ended by decision" in report["explanation"]


def test_kernel_text_detectors_run_offline(tmp_path: Path) -> None:
    # The streams worker's kernel-text detector (hung-task reports naming a filesystem) runs
    # offline too: a real Lustre hung-task trace (tests/fixtures/logs/SOURCES.md) read as kern.log.
    kern = tmp_path / "kern.log"
    kern.write_bytes((LOGS / "kernel_hung_lustre.log").read_bytes())
    rc, report = run_json(str(kern))
    assert (rc, report["category"], report["evidence"][0]["source"]) == (1, "storage", "kernel")


def test_directories_skip_binary_files_and_read_gzip(tmp_path: Path) -> None:
    import gzip

    case = "gpu_xid79_nccl_timeouts"
    for f in case_files(case):
        src = Path(f)
        if src.name.startswith("kern"):
            # A rotated, compressed kernel log keeps its kernel-log name.
            (tmp_path / f"{src.name}.2.gz").write_bytes(gzip.compress(src.read_bytes()))
        else:
            (tmp_path / src.name).write_bytes(src.read_bytes())
    (tmp_path / "core.python.1234").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64))
    rc, report = run_json(str(tmp_path))
    assert (rc, report["category"], report["culprit"]) == (1, "gpu_hardware", "gpu01")
    assert not any("core.python" in f for f in report["files"])
    assert any(f.endswith(".gz") for f in report["files"])
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    proc = run_cli("--json", str(tmp_path / "bad.gz"))
    assert proc.returncode == 2 and "not a readable gzip file" in proc.stderr


def test_xid_quoted_in_a_monitoring_alert() -> None:
    # An alert naming the instance and quoting its syslog Xid line (corpus dev case, m4-logs).
    rc, report = run_json(*case_files("gpu_m4_xid64_monitoring_instance"))
    assert (rc, report["category"], report["culprit"]) == (1, "gpu_hardware", "gpu02")
    assert report["evidence"][0]["source"] == "kernel"


def test_parked_threads_tell_a_hang_dump_from_a_crash_dump() -> None:
    from producers.joblogs import split_rank_prefix
    from streams.detectors.hang import parked_threads

    def texts(path: Path) -> list[str]:
        return [split_rank_prefix(x).text for x in path.read_text().splitlines()]

    # py-spy dumps of hung jobs: BLOOM's eval deadlock (broadcast) and accelerate#3104 (all_gather).
    bloom = parked_threads(texts(CORPUS / "hang_bloom_eval_pyspy_dumps" / "py-spy-gpu01.out"))
    assert bloom and bloom[0] == ("a collective", "broadcast (torch/distributed/distributed_c10d.py:1191)")
    accel = parked_threads(texts(PROGRESS / "pyspy_dump_allgather.log"))
    assert [what for what, _ in accel] == ["a collective"]  # the idle tqdm monitor's wait() is not one
    # faulthandler's dump after "Fatal Python error: Segmentation fault" is a crash report, not a hang.
    assert parked_threads(texts(CORPUS / "unknown_segfault_barrier" / "job.out")) == []
