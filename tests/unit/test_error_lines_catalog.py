"""streams/catalog/error_lines.yaml: loaded and checked, and checked against the other catalogs.

- every entry names its emitter's source and carries a line its emitter prints that matches it
  (the loader refuses one that does not, naming it);
- no not-fault entry explains away a line a fault signature recognises, on any dev case;
- a healthy dev case has no error-level line left unexplained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.catalog import CatalogError, default_signatures
from streams.catalog.error_lines import default_error_lines, load_error_lines
from streams.detectors.error_lines import ErrorLineReader
from streams.detectors.signatures import SignatureDetector
from tests.conftest import FIXTURES

DEV = FIXTURES / "corpus" / "dev"


def _dev_lines(prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for case in sorted(DEV.iterdir()):
        if not case.is_dir() or not case.name.startswith(prefix):
            continue
        for path in sorted(case.iterdir()):
            if path.name != "label.yaml":
                out += [(case.name, line) for line in path.read_text(errors="replace").splitlines()]
    return out


def test_every_entry_cites_its_source_and_the_emitters_are_pinned() -> None:
    emitters = default_error_lines()
    assert {e.emitter for e in emitters} >= {"nccl", "slurm", "pytorch", "python", "linux_kernel", "nvidia_driver"}
    for em in emitters:
        assert em.version.strip(), em.emitter
        for entry in (*em.error_level, *em.not_faults):
            assert entry.source.startswith(("http://", "https://")), (em.emitter, entry.id)


def test_an_example_its_pattern_does_not_match_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "error_lines.yaml"
    bad.write_text(
        "emitters:\n  - emitter: nccl\n    version: v1\n    error_level:\n"
        "      - id: nccl_warn\n        pattern: 'NCCL WARN'\n        source: https://example.org/debug.cc\n"
        "        example: 'NCCL INFO only'\n"
    )
    with pytest.raises(CatalogError, match="does not match the pattern"):
        load_error_lines(bad)


def test_no_not_fault_entry_explains_away_a_recognised_fault_line() -> None:
    reader, signatures = ErrorLineReader(), SignatureDetector(default_signatures())
    masked = []
    for case, line in _dev_lines():
        if case.startswith("healthy_"):
            continue
        hit = reader.read(line)
        noise = hit is not None and hit.not_fault is not None and hit.not_fault.kind == "noise"
        if noise and (sig := signatures.match_line(line)) is not None and sig[0].category != "unknown":
            masked.append((case, hit.entry if hit else "", sig[0].id, line[:120]))
    assert masked == []


def test_healthy_dev_cases_have_no_unexplained_error_level_line() -> None:
    reader, signatures = ErrorLineReader(), SignatureDetector(default_signatures())
    left = [
        (case, hit.entry, line[:120])
        for case, line in _dev_lines("healthy_")
        if (hit := reader.read(line)) is not None and hit.not_fault is None and signatures.match_line(line) is None
    ]
    assert left == []


# Each emitter's error-level form, filled in from the format string or text its source prints (the catalog
# entry cites file and version): the reader must name the entry, so a change to a pattern that loses the form
# fails here.
EMITTER_FORMS = [
    # NCCL src/init.cc ncclGetErrorString through torch's C10D_NCCL_CHECK, and getNcclErrorDetailStr's line
    (
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1269, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.14.3",
        "nccl_result_error",
    ),
    (
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
        "nccl_result_error",
    ),
    ("ncclInternalError: Internal check failed.", "nccl_result_error"),
    # CPython Modules/faulthandler.c and Python/pylifecycle.c
    ("Fatal Python error: Bus error", "py_fatal_error"),
    (
        "Fatal Python error: _PyMem_DebugMalloc: Python memory allocator called without holding the GIL",
        "py_fatal_error",
    ),
    # libstdc++ vterminate.cc
    ("terminate called after throwing an instance of 'c10::Error'", "cxx_terminate_called"),
    ("terminate called recursively", "cxx_terminate_called"),
    # bash jobs.c with glibc's strsignal texts: the interactive and the batch-script form
    ("Segmentation fault (core dumped)", "bash_fatal_signal"),
    ("Illegal instruction", "bash_fatal_signal"),
    (
        "/var/spool/slurmd/job4242/slurm_script: line 42: 91234 Bus error               python train.py",
        "bash_fatal_signal",
    ),
    # DeepSpeed launch.py sigkill_handler through pdsh, without its logger's [ERROR] field
    (
        "gpu02: ['/usr/bin/python3', '-u', 'train.py', '--local_rank=1'] exits with return code = -6",
        "ds_exits_with_return_code",
    ),
    # Open MPI opal/util/stacktrace.c and help-orterun.txt
    ("[gpu01:12345] *** Process received signal ***", "ompi_process_received_signal"),
    (
        "mpiexec detected that one or more processes exited with non-zero status, thus causing",
        "ompi_detected_non_zero_status",
    ),
    # Linux kernel/watchdog.c, kernel/sched/core.c, kernel/panic.c, arch/x86/kernel/dumpstack.c
    ("watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python3:41234]", "kernel_bug_report"),
    ("BUG: scheduling while atomic: python3/41234/0x00000002", "kernel_bug_report"),
    ("Kernel panic - not syncing: Fatal exception", "kernel_panic"),
    ("[ 1234.567890] Call Trace:", "kernel_call_trace"),
    # Python logging's level names in layouts programs give their Formatter (fairseq's " | ", "[%(levelname)s]",
    # '%(levelname)s: %(message)s') and loguru's "{level: <8} |"
    ("2024-05-01 12:00:00 | ERROR | fairseq.trainer | OOM: Ran out of memory with exception", "py_logging_level_field"),
    ("[2024-05-01 12:00:00] [ERROR] dataset shard 17 unreadable", "py_logging_level_field"),
    ("ERROR: Unexpected bus error encountered in worker.", "py_logging_level_field"),
    ("2024-05-01 12:00:00 | CRITICAL | train:main:12 - giving up", "py_logging_level_field"),
    # Linux kernel/watchdog.c, arch/x86/mm/fault.c and arch/x86/kernel/traps.c; systemd's coredump record
    ("NMI watchdog: Watchdog detected hard LOCKUP on cpu 17", "kernel_hard_lockup"),
    (
        "python3[41234]: segfault at 0 ip 00007f3a2b4c5d6e sp 00007ffd1a2b3c40 error 4 in libc.so.6[7f3a2b400000+195000]",
        "kernel_user_fault",
    ),
    ("traps: python3[41234] general protection fault ip:7f3a2b4c5d6e sp:7ffd1a2b3c40 error:0", "kernel_user_fault"),
    ("systemd-coredump[51234]: Process 41234 (python3) of user 1000 dumped core.", "systemd_process_dumped_core"),
    # cuDNN's status enum as torch prints it; TensorFlow/XLA's default log sink; Apptainer's sylog prefix
    ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR", "cuda_library_status"),
    (
        "2024-05-01 12:00:00.123456: E external/xla/xla/pjrt/pjrt_stream_executor_client.cc:2809] Execution of "
        "replica 0 failed: INTERNAL: Failed to complete all kernels launched on stream",
        "tsl_log_error_or_fatal",
    ),
    ("FATAL:   container creation failed: while mounting image", "apptainer_fatal_or_error"),
    # PBS MoM's and LSF's reasons for killing a job that are faults (memory over the request)
    ("=>> PBS: job killed: mem job total 2097152 kb exceeded limit 1048576 kb", "pbs_job_killed"),
    ("TERM_MEMLIMIT: job killed after reaching LSF memory usage limit.", "lsf_term_reason"),
    # c10's MessageLogger prints nanoseconds in the glog prefix
    ("E0501 12:00:00.123456789 12345 ProcessGroupNCCL.cpp:1200] something failed", "glog_error_or_fatal"),
]


@pytest.mark.parametrize("line,entry", EMITTER_FORMS, ids=[e for _, e in EMITTER_FORMS])
def test_each_emitters_error_form_is_error_level(line: str, entry: str) -> None:
    hit = ErrorLineReader().read(line)
    assert hit is not None and hit.entry == entry and hit.not_fault is None, hit


# Below error level in the same emitters (Python logging WARNING/INFO, glog W/I, NCCL's non-blocking
# ncclInProgress), or words that only name a level: none of them is error-level.
NOT_ERROR_LEVEL = [
    "2024-05-01 12:00:00 | WARNING | fairseq.trainer | NOTE: overflow detected, setting loss scale to: 16384.0",
    "[2024-05-01 12:00:00] [INFO] saving checkpoint",
    "W0501 12:00:00.123456789 12345 ProcessGroupNCCL.cpp:1200] Warning: something",
    "NCCL operation in progress",
    "2024-05-01 12:00:00.123456: W tensorflow/core/common_runtime/gpu/gpu_device.cc:2256] Cannot dlopen some GPU libraries.",
    "cublasStatus_t CUBLAS_STATUS_SUCCESS",
    "WARNING: underlay of /etc/localtime required more than 50 (66) bind mounts",
    "log_level: ERROR",
    "--log-level ERROR --seed 1",
    "DEBUG: collecting batch 17",
    "Aborted by user? no: continuing",
]


@pytest.mark.parametrize("line", NOT_ERROR_LEVEL)
def test_lines_below_error_level_are_not_error_level(line: str) -> None:
    assert ErrorLineReader().read(line) is None


# Stops by decision as each program prints them (bash's SIGTERM report, Lightning's signal connector and
# trainer, Megatron's exit signal handler).
DECISIONS = [
    (
        "/var/spool/slurmd/job4242/slurm_script: line 42: 91234 Terminated              srun python train.py",
        "bash_terminated_by_sigterm",
    ),
    ("[rank: 0] Received SIGTERM: 15", "lightning_received_sigterm"),
    ("Handling auto-requeue signal: 10", "lightning_auto_requeue"),
    ("Requeued SLURM job: 4242", "lightning_auto_requeue"),
    ("Detected KeyboardInterrupt, attempting graceful shutdown ...", "lightning_keyboard_interrupt"),
    ("[exiting program after receiving SIGTERM.] datetime: 2024-05-01 12:00:00", "megatron_exit_after_sigterm"),
    ("=>> PBS: job killed: walltime 3630 exceeded limit 3600", "pbs_walltime_exceeded"),
    ("=>> PBS: job killed: cput job total 7300 secs exceeded limit 7200", "pbs_walltime_exceeded"),
    ("TERM_RUNLIMIT: job killed after reaching LSF run time limit.", "lsf_term_by_decision"),
    ("TERM_OWNER: job killed by owner.", "lsf_term_by_decision"),
]


@pytest.mark.parametrize("line,entry", DECISIONS, ids=[e for _, e in DECISIONS])
def test_each_stop_by_decision_form_is_recognised(line: str, entry: str) -> None:
    hit = ErrorLineReader().read(line)
    assert hit is not None and hit.entry == entry and hit.ends_by_decision, hit
