"""`healthy` needs positive evidence, and a run its operator or scheduler ended is no fault.

The lines are the emitters' own forms, filled in from the format strings streams/catalog/
error_lines.yaml cites (Slurm's slurmstepd, torch.distributed.elastic, NCCL, c10's logging) or,
where named, copied from a dev case of the corpus.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.detectors.error_lines import ErrorLineReader
from tests.conftest import FIXTURES
from trainmedic.ops.diagnose import diagnose_paths

DEV = FIXTURES / "corpus" / "dev"
PROGRESS = [f"step {i} loss: {3.1 - i * 0.01:.4f}" for i in range(1, 8)]
TIME_LIMIT = "slurmstepd: error: *** JOB 4242 ON gpu01 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***"
SCANCEL = "slurmstepd: error: *** STEP 4242.0 ON gpu01 CANCELLED AT 2024-05-01T10:00:00 ***"
TORCHRUN_SIGTERM = [
    "WARNING:torch.distributed.elastic.agent.server.api:Received Signals.SIGTERM death signal, shutting down workers",
    "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 1201 closing signal SIGTERM",
    "Traceback (most recent call last):",
    '  File "/usr/bin/torchrun", line 8, in <module>',
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1190 got signal: 15",
]
WATCHDOG = (
    "[rank3]:[E ProcessGroupNCCL.cpp:563] [Rank 3] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1202, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600032 "
    "milliseconds before timing out."
)


def diagnose(tmp_path: Path, *lines: str) -> dict[str, object]:
    log = tmp_path / "job.out"
    log.write_text("\n".join(lines) + "\n")
    return diagnose_paths([log])


def test_a_clean_run_is_healthy_and_says_what_was_checked(tmp_path: Path) -> None:
    report = diagnose(
        tmp_path,
        "gpu01:1190:1190 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
        "/opt/conda/lib/python3.10/site-packages/torch/utils/data/dataloader.py:557: UserWarning: This DataLoader "
        "will create 8 worker processes in total.",
        *PROGRESS,
    )
    assert (report["category"], report["action"]) == ("healthy", "none")
    assert "progress reports checked" in str(report["explanation"])
    assert "progress to the end of the log" in str(report["explanation"]) and report["confidence"] == 0.8


def test_an_unexplained_error_level_line_is_unknown_with_the_line_quoted(tmp_path: Path) -> None:
    odd = "[E socket.cpp:922] [c10d] The server socket has failed to listen on any local network address."
    report = diagnose(tmp_path, *PROGRESS, odd)
    assert (report["category"], report["action"]) == ("unknown", "none")
    assert report["evidence"][0]["line"] == odd  # type: ignore[index]
    assert "error-level line of pytorch" in str(report["explanation"]) or odd in str(report["explanation"])


def test_a_warning_is_not_error_level(tmp_path: Path) -> None:
    warning = "[W socket.cpp:464] [c10d] The server socket cannot be initialized on [::]:29500 (errno: 97)."
    assert ErrorLineReader().read(warning) is None or ErrorLineReader().read(warning).not_fault is not None  # type: ignore[union-attr]
    assert diagnose(tmp_path, *PROGRESS, warning)["category"] == "healthy"


PREEMPTED = "slurmstepd: error: *** JOB 4242 ON gpu01 CANCELLED AT 2024-05-01T10:00:00 DUE TO PREEMPTION ***"
SRUN_TERMINATED = "srun: error: gpu01: tasks 0-7: Terminated"
DS_SIGTERM = "[2024-05-01 10:00:00,123] [INFO] [launch.py:319:sigkill_handler] Main process received SIGTERM, exiting"
KEYBOARD = "[rank0]: KeyboardInterrupt"


@pytest.mark.parametrize(
    "stop",
    [TIME_LIMIT, SCANCEL, PREEMPTED, SRUN_TERMINATED, DS_SIGTERM, KEYBOARD],
    ids=["time-limit", "scancel", "preemption", "srun-terminated", "deepspeed-sigterm", "keyboard-interrupt"],
)
def test_a_run_ended_by_decision_is_healthy_whatever_crashes_after(tmp_path: Path, stop: str) -> None:
    report = diagnose(tmp_path, *PROGRESS, stop, *TORCHRUN_SIGTERM, WATCHDOG, "srun: error: gpu01: task 0: Killed")
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]
    assert "ended by decision" in str(report["explanation"]) and report["confidence"] == 0.9


def test_torchrun_told_to_stop_on_every_rank_is_healthy(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *PROGRESS, *TORCHRUN_SIGTERM, "exitcode  : -15 (pid: 1201)")
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]


def test_a_cause_before_the_stop_still_counts(tmp_path: Path) -> None:
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.20 GiB is free."
    )
    report = diagnose(tmp_path, *PROGRESS, oom, SCANCEL, *TORCHRUN_SIGTERM)
    assert (report["category"], report["action"]) == ("oom", "stop")


def test_the_dev_time_limit_case_stays_healthy() -> None:
    case = DEV / "healthy_tr1_time_limit_exit_checkpoint"
    report = diagnose_paths([p for p in sorted(case.iterdir()) if p.name != "label.yaml"])
    assert (report["category"], report["action"]) == ("healthy", "none")


# Dynamic loss scaling halving the scale on an fp16 overflow and going on: each form as its emitter's
# format string prints it (DeepSpeed deepspeed/runtime/fp16/loss_scaler.py update_scale and
# fused/unfused_optimizer.py; apex amp/handle.py skip_step; fairseq fairseq/trainer.py; tensorboardX's
# x2num warning printed beside them).
LOSS_SCALING = [
    "[2023-07-24 13:21:32,378] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 4294967296, reducing to 2147483648",
    "[2024-09-15 00:13:28,261] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 4294967296, but hysteresis is 2. Reducing hysteresis to 1",
    " [deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 262144, reducing to 131072.0",
    "[2026-06-18 23:36:56,643] [INFO] [unfused_optimizer.py:281:_update_scale] Grad overflow on iteration: 4",
    "[2026-06-18 23:36:56,643] [INFO] [unfused_optimizer.py:207:step] [deepspeed] fp16 dynamic loss scale overflow! "
    "Skipping step. Attempted loss scale: 65536.0, reducing to 32768.0",
    "OVERFLOW! Skipping step. Attempted loss scale: 65536.0, reducing to 32768.0",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0",
    "2023-06-13 17:37:40 | INFO | fairseq.trainer | NOTE: overflow detected, setting loss scale to: 16384.0",
    "2024-02-29 07:58:54 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting "
    "loss scale to: 64.0",
    "[1,0]<stdout>:Warning: NaN or Inf found in input tensor.",
]


@pytest.mark.parametrize("line", LOSS_SCALING)
def test_loss_scaling_that_halves_and_goes_on_is_healthy(tmp_path: Path, line: str) -> None:
    report = diagnose(tmp_path, *PROGRESS[:4], line, *PROGRESS[4:])
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]


# Error-level lines no fault signature recognises, each in its emitter's own form (the catalog entry that reads
# it cites the source): after clean progress, each makes the verdict unknown with the line quoted, never healthy.
UNRECOGNISED_ERRORS = [
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.",
    "[gpu01:12345] *** Process received signal ***",
    "mpirun detected that one or more processes exited with non-zero status, thus causing",
    "2024-05-01 12:00:00 | ERROR | train:main:12 - dataset shard 17 unreadable",
    "[2024-05-01 12:00:00] [ERROR] dataset shard 17 unreadable",
    "ERROR: worker 3 lost its connection",
    "E0501 12:00:00.123456789 12345 ProcessGroupNCCL.cpp:1200] something failed",
    "=>> PBS: job killed: mem job total 2097152 kb exceeded limit 1048576 kb",
]


@pytest.mark.parametrize("line", UNRECOGNISED_ERRORS)
def test_an_unrecognised_error_form_after_progress_is_unknown(tmp_path: Path, line: str) -> None:
    report = diagnose(tmp_path, *PROGRESS, line)
    assert (report["category"], report["action"]) == ("unknown", "none"), report["explanation"]
    assert line in str(report["explanation"])


def test_a_kernel_call_trace_nothing_else_explains_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "job.out").write_text("\n".join(PROGRESS) + "\n")
    (tmp_path / "kern.log").write_text("May  1 12:00:00 gpu01 kernel: [ 1234.567890] Call Trace:\n")
    report = diagnose_paths([tmp_path / "job.out", tmp_path / "kern.log"])
    assert (report["category"], report["action"]) == ("unknown", "none"), report["explanation"]


# Lines a run prints that say nothing about why its progress reports stopped.
UNEXPLAINED_TAIL = [
    "worker 3: entering barrier",
    "worker 5: entering barrier",
    "worker 1: entering barrier",
    "worker 7: entering barrier",
]


def test_progress_that_stops_before_unexplained_lines_is_unknown(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *PROGRESS, *UNEXPLAINED_TAIL)
    assert (report["category"], report["action"]) == ("unknown", "none"), report["explanation"]
    assert "progress stopped 4 lines before the end" in str(report["explanation"])
    assert report["evidence"][0]["line"] == UNEXPLAINED_TAIL[0]  # type: ignore[index]


def test_a_line_or_two_after_the_last_progress_is_no_stop(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *PROGRESS, *UNEXPLAINED_TAIL[:2])
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]


def test_progress_followed_by_a_completion_line_is_healthy(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *PROGRESS, *UNEXPLAINED_TAIL, "Training completed. Do not forget to share your model")
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]
    assert "a completion line" in str(report["explanation"])


# What may follow the last progress report of a healthy run: records below error level, evaluation and
# checkpoint lines, a timer table, separators (Megatron's validation block and timers, Python logging INFO,
# glog I, NCCL INFO).
EXPLAINED_TAIL = [
    "-" * 60,
    " validation loss at iteration 7 | lm loss value: 3.012 | lm loss PPL: 20.33 |",
    "-" * 60,
    "saving checkpoint at iteration       7 to checkpoints",
    "time (ms) | save-checkpoint: 5751.45",
    "INFO:root:uploading metrics",
    "I0501 12:00:00.123456 12345 trainer.py:88] waiting for the data loader",
    "gpu01:1190:1190 [0] NCCL INFO comm 0x55d0 rank 0 nranks 8 cudaDev 0 busId 1000 - Destroy COMPLETE",
]


def test_progress_followed_only_by_explained_lines_is_healthy(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *PROGRESS, *EXPLAINED_TAIL)
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]
    assert "each after it explained" in str(report["explanation"]) and report["confidence"] == 0.75


# Stops by decision in the forms bash, Lightning and Megatron print them: what follows is the stop's consequence.
STOPS = [
    "/var/spool/slurmd/job4242/slurm_script: line 42: 91234 Terminated              srun python train.py",
    "[rank: 0] Received SIGTERM: 15",
    "Handling auto-requeue signal: 10",
    "Detected KeyboardInterrupt, attempting graceful shutdown ...",
    "[exiting program after receiving SIGTERM.] datetime: 2024-05-01 12:00:00",
    "=>> PBS: job killed: walltime 3630 exceeded limit 3600",
    "TERM_RUNLIMIT: job killed after reaching LSF run time limit.",
]


@pytest.mark.parametrize(
    "stop",
    STOPS,
    ids=[
        "bash-terminated",
        "lightning-sigterm",
        "lightning-requeue",
        "lightning-ctrl-c",
        "megatron-sigterm",
        "pbs-walltime",
        "lsf-runlimit",
    ],
)
def test_more_stop_forms_are_healthy_whatever_crashes_after(tmp_path: Path, stop: str) -> None:
    report = diagnose(tmp_path, *PROGRESS, stop, *UNEXPLAINED_TAIL, WATCHDOG, "srun: error: gpu01: task 0: Killed")
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]
    assert "ended by decision" in str(report["explanation"])


def test_a_log_of_which_nothing_is_recognised_is_unknown(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *UNEXPLAINED_TAIL)
    assert (report["category"], report["action"]) == ("unknown", "none"), report["explanation"]
    assert "none of the 4 lines of the logs is recognised" in str(report["explanation"])


def test_one_record_below_error_level_is_enough_to_say_the_run_went_on(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *UNEXPLAINED_TAIL, "INFO:root:epoch 1 done")
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]
    assert report["confidence"] == 0.6


def test_pips_resolver_notice_at_the_start_of_a_run_is_noise(tmp_path: Path) -> None:
    # pip's install.py logs it at critical ("ERROR: " prefix) after a successful install
    notice = (
        "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
        "This behaviour is the source of the following dependency conflicts."
    )
    report = diagnose(tmp_path, notice, *PROGRESS)
    assert (report["category"], report["action"]) == ("healthy", "none"), report["explanation"]
    assert "1 known noise" in str(report["explanation"])


# --- a hang at exit: done, then silence until the time limit (Megatron-Bridge issue 1656) ---------

EXIT_HANG = DEV / "hang_megatron_bridge_exit_hang_time_limit"
DONE = "[after training is done] datetime: 2025-12-03 14:45:03"
LIMIT = "slurmstepd: error: *** STEP 4226796.2 ON gpu01 CANCELLED AT {} DUE TO TIME LIMIT ***"


def test_done_then_silence_until_the_time_limit_is_a_hang() -> None:
    report = diagnose_paths([EXIT_HANG / "job.out"])
    assert (report["category"], report["action"]) == ("hang", "requeue")
    lines = [e["line"] for e in report["evidence"]]  # type: ignore[attr-defined]
    assert any("then nothing for 479 s until the time limit" in line for line in lines), lines


def test_done_then_the_time_limit_within_the_hang_floor_is_healthy(tmp_path: Path) -> None:
    # The same lines with the cancel 20 s after the completion line: an exit the limit overtook.
    report = diagnose(tmp_path, *PROGRESS, DONE, LIMIT.format("2025-12-03T14:45:23"))
    assert (report["category"], report["action"]) == ("healthy", "none")


def test_a_final_save_cut_by_the_time_limit_is_no_exit_hang(tmp_path: Path) -> None:
    # Megatron saves after "after training is done": a save at work when the limit comes is no hang.
    save = "saving checkpoint at iteration      50 to /ckpt"
    report = diagnose(tmp_path, *PROGRESS, DONE, save, LIMIT.format("2025-12-03T14:53:02"))
    assert (report["category"], report["action"]) == ("healthy", "none")


def test_the_time_limit_with_no_completion_line_stays_healthy(tmp_path: Path) -> None:
    report = diagnose(tmp_path, *PROGRESS, LIMIT.format("2025-12-03T14:53:02"))
    assert (report["category"], report["action"]) == ("healthy", "none")


# --- fp16 loss scale near its floor ----------------------------------------------------------------


def test_loss_scale_halved_down_to_its_floor_mid_run_is_numerical() -> None:
    report = diagnose_paths([DEV / "num_deepspeed_overflow_streak_scale_collapse" / "job.out"])
    assert (report["category"], report["action"]) == ("numerical", "stop")


def test_loss_scale_halvings_at_the_start_of_a_run_are_healthy() -> None:
    for case in ("healthy_t5_11b_deepspeed_overflow_start", "healthy_deepspeed_stage2_overflow_from_2pow32"):
        report = diagnose_paths([DEV / case / "job.out"])
        assert (report["category"], report["action"]) == ("healthy", "none"), case
