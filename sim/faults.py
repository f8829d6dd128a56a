"""Fault library for the cluster simulator: what each fault writes, what the truth is.

Every fault line is a real text: copied from tests/fixtures (logs/ and corpus/,
sources cited there) with only the host name, rank prefix and time stamp
substituted, as a real cluster would print them. The one exception is the Xid 74
kernel line, for which tests/fixtures has no kernel log: its text is the message
format NVIDIA documents for NVSentinel's Xid 74 workflow (source below).
`FIXTURE_TEXTS` maps each constant to the fixture file that holds it verbatim;
tests/e2e/test_bench_smoke.py checks that it does.

Expected category and action are what trainmedic should conclude under the
default policy (streams/policies/default.yaml). `baseline` says when the status quo
(no trainmedic) finds out: ``watchdog`` when NCCL's watchdog fires (600 s by
default) on the ranks that wait for the dead one, ``crash`` when the process
exits (the fault line is the crash), ``silent`` when nothing fails at all (a
hang outside a collective, a straggler, a diverged loss) and a person has to
notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Baseline = Literal["watchdog", "crash", "silent"]

NCCL_TIMEOUT_MS = 600_000


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    title: str
    category: str  # expected incident category
    action: str  # expected action under the default policy
    culprit_scored: bool  # the truth names a node that attribution must find
    evidence: str  # which input shows it to trainmedic
    signatures: tuple[str, ...]  # catalog entries (or detector names) expected to fire
    baseline: Baseline
    persistent: bool  # the node stays bad: a restart placed on it fails again
    min_nodes: int = 2
    long_window: bool = False  # needs the hang (>= 30 s) or straggler (>= 120 s) windows
    note: str = ""


FAULTS: dict[str, FaultSpec] = {
    s.kind: s
    for s in (
        FaultSpec(
            "xid79",
            "Xid 79: GPU fallen off the bus",
            "gpu_hardware",
            "drain_and_requeue",
            True,
            "kernel log (NVRM Xid 79) + NCCL timeouts of the peers",
            ("xid_79",),
            "watchdog",
            True,
        ),
        FaultSpec(
            "xid48_dbe",
            "Xid 48: double-bit ECC error",
            "gpu_hardware",
            "drain_and_requeue",
            True,
            "kernel log (Xid 48) + CUDA 'uncorrectable ECC error' on the rank + ECC counter",
            ("xid_48", "cuda_uncorrectable_ecc"),
            "crash",
            True,
        ),
        FaultSpec(
            "xid64_row_remap",
            "Xid 64: row-remap (page retirement) failure",
            "gpu_hardware",
            "drain_and_requeue",
            True,
            "kernel log (Xid 64) + remapped_rows_failed in GPU metrics",
            ("xid_64",),
            "watchdog",
            True,
        ),
        FaultSpec(
            "xid74_nvlink",
            "Xid 74: NVLink error",
            "interconnect",
            "drain_and_requeue",
            True,
            "kernel log (Xid 74) + CUDA 'uncorrectable NVLink error' on the rank",
            ("xid_74", "cuda_uncorrectable_nvlink"),
            "crash",
            True,
        ),
        FaultSpec(
            "nccl_dead_rank",
            "NCCL timeout caused by a dead rank",
            "interconnect",
            "requeue",
            True,
            "NCCL watchdog timeouts on every other node; the dead node says nothing",
            ("nccl_watchdog_timeout",),
            "watchdog",
            False,
            min_nodes=3,
            note=(
                "with a compressed watchdog (--quick: 10 s) the peers' NCCL timeouts come first: collateral only, "
                "interconnect at confidence 0.4, so recommend only, the silent node named in the explanation; with "
                "NCCL's real 600 s the stalled job is found by the hang detector first (expected: hang, requeue)"
            ),
        ),
        FaultSpec(
            "ib_link_flap",
            "InfiniBand link flap",
            "interconnect",
            "drain_and_requeue",
            True,
            "NCCL 'NET/IB : Got async event : port error' on the node's ranks (kernel mlx5 'Link DOWN' too)",
            ("ib_port_error",),
            "watchdog",
            False,
            note="the node's own adapter or port: the signature isolates it, so policy drains it before the requeue",
        ),
        FaultSpec(
            "hang",
            "Hang: progress stops, GPUs idle",
            "hang",
            "requeue",
            False,
            "progress silence (hang detector)",
            ("hang",),
            "silent",
            False,
            long_window=True,
            note="idle GPUs: stuck outside a collective, so NCCL's watchdog never fires",
        ),
        FaultSpec(
            "straggler",
            "Straggler: thermal throttle on one node",
            "gpu_hardware",
            "drain_and_requeue",
            True,
            "hw_thermal throttle reason + lower SM clock/power on one node (straggler detector)",
            ("straggler",),
            "silent",
            True,
            long_window=True,
        ),
        FaultSpec(
            "cuda_oom",
            "CUDA out of memory",
            "oom",
            "stop",
            False,
            "job log: OutOfMemoryError",
            ("cuda_oom",),
            "crash",
            False,
        ),
        FaultSpec(
            "nan_loss",
            "NaN loss / gradient norm",
            "numerical",
            "stop",
            False,
            "Megatron iteration lines with 'grad norm: nan'",
            ("megatron_nan_grad_norm",),
            "silent",
            False,
            note="the job keeps running and burns GPU hours on a diverged model",
        ),
        FaultSpec(
            "user_exception",
            "User exception on one rank",
            "user_code",
            "stop",
            False,
            "job log: Python traceback ending in ValueError",
            ("python_exception",),
            "crash",
            False,
            note="python_exception is severity warning: confidence 0.5-0.55 < min_confidence 0.6, so recommend only",
        ),
        FaultSpec(
            "storage_full",
            "Checkpoint storage full",
            "storage",
            "stop",
            False,
            "job log: OSError [Errno 28] No space left on device during the checkpoint save",
            ("storage_no_space",),
            "crash",
            False,
        ),
        FaultSpec(
            "node_not_responding",
            "Node not responding",
            "node",
            "drain_and_requeue",
            True,
            "srun 'Node failure on <node>' in the job log (+ scheduler node DOWN/NOT_RESPONDING event)",
            ("srun_node_failure",),
            "crash",
            True,
            min_nodes=2,
            note="no detector reads scheduler node events: the srun line carries it",
        ),
    )
}

EXPLICIT_KINDS = tuple(k for k, s in FAULTS.items() if not s.long_window)
ALL_KINDS = tuple(FAULTS)

# --- real texts (fixtures) ---------------------------------------------------------------------

# tests/fixtures/logs/xid79_kern.log (journalctl -k); host gpu01, time "Sep 09 15:53:19".
XID79_KERN = (
    "Sep 09 15:53:19 gpu01 kernel: NVRM: Xid (PCI:0000:10:00): 79, pid=0, GPU has fallen off the bus.",
    "Sep 09 15:53:19 gpu01 kernel: NVRM: GPU 0000:10:00.0: GPU has fallen off the bus.",
)
# tests/fixtures/logs/xid48_kern.log (syslog with the kernel's own uptime stamp); host gpu02.
XID48_KERN = (
    "Dec  2 11:38:47 gpu02 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, "
    "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr 0x7fffa8860 "
    "partition 7, subpartition 1."
)
XID64_KERN = (
    "Dec  2 11:38:47 gpu02 kernel: [  219.471050] NVRM: Xid (PCI:0000:07:00): 64, pid='<unknown>', name=<unknown>, "
    "Dynamic Page Retirement: Blacklisting failed.  Page should have been blacklisted on boot(0x00000000007fffa8)."
)
# Not in tests/fixtures: the message format NVIDIA documents for Xid 74 in NVSentinel's design
# "Implement WORKFLOW_NVLINK_ERR" (docs/designs/019-workflow-nvlink-err.md), prefixed with a
# syslog stamp and host as the other kernel lines.
XID74_MESSAGE = (
    "[449410.332316] NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, "
    "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"
)
# tests/fixtures/corpus/dev/gpu_cuda_ecc_uncorrectable/job.out
CUDA_ECC_LINES = (
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
)
# tests/unit/test_catalog.py (cuda_uncorrectable_nvlink, https://github.com/MIC-DKFZ/nnUNet/issues/1519)
CUDA_NVLINK_LINE = "RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution"
# tests/fixtures/logs/nccl_watchdog_timeout.log, line 1 (rank 0, time E1206 18:44:12.715298746).
WATCHDOG_LINE = (
    "[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, NumelOut=68124672, "
    "Timeout(ms)=600000) ran for 600061 milliseconds before timing out."
)
# tests/fixtures/corpus/dev/ic_ib_port_error_flapping_link/job.out: the node's eight ranks (pid:tid differ).
IB_PORT_ERROR_LINES = tuple(
    f"gpu01:{pid} [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port error"
    for pid in (
        "34050:34121",
        "34052:34141",
        "34055:34140",
        "34051:34143",
        "34054:34130",
        "34057:34142",
        "34053:34129",
        "34056:34135",
    )
)
# tests/unit/test_catalog.py (ib_link_down, the kernel's own example) and its healthy list (Link ACTIVE).
IB_KERNEL_DOWN = "mlx5_core 0000:08:00.0 mlx5_0: Port: 1 Link DOWN"
IB_KERNEL_UP = "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE"
# tests/fixtures/corpus/dev/oom_cuda_zero3_80gb/job.out (the line break after "If" is in the source).
OOM_LINES = (
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 172.00 MiB (GPU 0; 79.35 GiB total capacity; "
    "73.95 GiB already allocated; 12.19 MiB free; 76.80 GiB reserved in total by PyTorch) If ",
    "reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  "
    "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
)
# tests/fixtures/corpus/dev/num_megatron_grad_norm_nan/job.out, first line: the format of a diverged step.
NAN_ITERATION_LINE = (
    " iteration     5426/  250000 | consumed samples:        43408 | consumed tokens:     88899584 | "
    "elapsed time per iteration (ms): 4247.9 | learning rate: 2.999E-04 | global batch size:     8 | "
    "loss scale: 1.0 | grad norm: nan | actual seqlen:  2048 | number of skipped iterations:   0 | "
    "number of nan iterations:   0 | samples per second: 1.883 | TFLOPs: 78.36 |"
)
# tests/fixtures/corpus/dev/user_valueerror_bad_config/job.out
USER_EXCEPTION_LINES = (
    "    return cls.__new__(cls, value)",
    '  File "/gpfswork/rech/cnw/commun/conda/shared-m4-2023-02-28/lib/python3.8/enum.py", line 663, in __new__',
    "    raise ve_exc",
    "ValueError: 'jsonl' is not a valid LoggingTypes",
)
# tests/fixtures/corpus/dev/storage_enospc_checkpoint_save/job.out
_ENOSPC_PREFIX = "2023-04-29 06:01:12.977 [177/train/578 (pid 28936)] [09c561ee-a44c-4795-967c-7183a83b3160] "
STORAGE_FULL_LINES = tuple(
    _ENOSPC_PREFIX + t
    for t in (
        "2023-04-29 06:01:12 ERROR [__main__] main failed",
        "Traceback (most recent call last):",
        '  File "/opt/conda/lib/python3.7/site-packages/torch/serialization.py", line 379, in save',
        "    _save(obj, opened_zipfile, pickle_module, pickle_protocol)",
        '  File "/opt/conda/lib/python3.7/site-packages/torch/serialization.py", line 604, in _save',
        "    zip_file.write_record(name, storage.data_ptr(), num_bytes)",
        "OSError: [Errno 28] No space left on device",
    )
)
# tests/fixtures/corpus/dev/node_failure_after_cuda_error/job.out and node_failure_during_validation/job.out
SRUN_NODE_FAILURE = "srun: error: Node failure on gpu03"
SRUN_STEP_ABORTED = "srun: Job step aborted: Waiting up to 62 seconds for job step to finish."
STEP_CANCELLED_NODE_FAILURE = (
    "slurmstepd: error: *** STEP 1943824.0 ON gpu01 CANCELLED AT 2023-03-06T03:17:51 DUE TO NODE FAILURE, "
    "SEE SLURMCTLD LOG FOR DETAILS ***"
)

# --- healthy noise (fixtures: must not be taken for faults) ----------------------------------------

# tests/fixtures/logs/healthy_training.log (NCCL init on a node without InfiniBand verbs)
NCCL_INIT_LINES = (
    "gpu01:1379562:1379562 [0] NCCL INFO Bootstrap : Using enp36s0f1:10.0.0.1<0>",
    "gpu01:1379562:1379562 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation",
    "gpu01:1379562:1379562 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]",
    "gpu01:1379562:1379562 [0] NCCL INFO NET/Socket : Using [0]enp36s0f1:10.0.0.1<0>",
    "gpu01:1379562:1379562 [0] NCCL INFO Using network Socket",
)
# tests/fixtures/corpus/dev/healthy_megatron_gpt2_345m/job.out
USER_WARNING_LINES = (
    "/usr/local/lib/python3.8/dist-packages/torch/distributed/distributed_c10d.py:2603: UserWarning: "
    "torch.distributed._all_gather_base is a private function and will be deprecated. Please use "
    "torch.distributed.all_gather_into_tensor instead.",
    "  warnings.warn(",
)
# tests/fixtures/corpus/dev/healthy_deepspeed_overflow_recovers/job.out (fp16 loss-scale warm-up)
OVERFLOW_LINE = (
    "[2024-09-11 17:52:18,030] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "
    "step. Attempted loss scale: 4294967296, reducing to 2147483648"
)
# tests/fixtures/progress/megatron.log: iteration, checkpoint start and end lines.
ITERATION_LINE = (
    " iteration      100/    5000 | consumed samples:         1600 | elapsed time per iteration (ms): 858.6 | "
    "learning rate: 3.984E-06 | global batch size:    16 | lm loss: 9.674668E+00 | loss scale: 262144.0 | "
    "grad norm: 3.750 | number of skipped iterations:  15 | number of nan iterations:   0 |"
)
CKPT_START_LINE = "saving checkpoint at iteration     400 to customer_scripts/checkpoints/3b"
CKPT_END_LINE = "  successfully saved checkpoint at iteration     400 to customer_scripts/checkpoints/3b"

FIXTURE_TEXTS: dict[str, tuple[str, ...]] = {
    "logs/xid79_kern.log": XID79_KERN,
    "logs/xid48_kern.log": (XID48_KERN, XID64_KERN),
    "corpus/dev/gpu_cuda_ecc_uncorrectable/job.out": CUDA_ECC_LINES,
    "logs/nccl_watchdog_timeout.log": (WATCHDOG_LINE,),
    "corpus/dev/ic_ib_port_error_flapping_link/job.out": IB_PORT_ERROR_LINES,
    "corpus/dev/oom_cuda_zero3_80gb/job.out": OOM_LINES,
    "corpus/dev/num_megatron_grad_norm_nan/job.out": (NAN_ITERATION_LINE,),
    "corpus/dev/user_valueerror_bad_config/job.out": USER_EXCEPTION_LINES,
    "corpus/dev/storage_enospc_checkpoint_save/job.out": STORAGE_FULL_LINES,
    "corpus/dev/node_failure_after_cuda_error/job.out": (SRUN_NODE_FAILURE, SRUN_STEP_ABORTED),
    "corpus/dev/node_failure_during_validation/job.out": (STEP_CANCELLED_NODE_FAILURE,),
    "logs/healthy_training.log": NCCL_INIT_LINES,
    "corpus/dev/healthy_megatron_gpt2_345m/job.out": USER_WARNING_LINES,
    "corpus/dev/healthy_deepspeed_overflow_recovers/job.out": (OVERFLOW_LINE,),
    "progress/megatron.log": (ITERATION_LINE, CKPT_START_LINE, CKPT_END_LINE),
}

# --- builders: the real texts, placed on this cluster --------------------------------------------


def syslog_stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%b %d %H:%M:%S")


def kernel_lines(kind: str, node: str, pci: str, t: float) -> list[str]:
    """The kernel-log lines of a GPU fault on `node`, for the GPU at bus id `pci`."""
    stamp = syslog_stamp(t)
    if kind == "xid79":
        return [
            line.replace("Sep 09 15:53:19 gpu01 ", f"{stamp} {node} ").replace("0000:10:00", pci) for line in XID79_KERN
        ]
    if kind == "xid48_dbe":
        return [XID48_KERN.replace("Dec  2 11:38:47 gpu02 ", f"{stamp} {node} ").replace("0000:07:00", pci)]
    if kind == "xid64_row_remap":
        return [XID64_KERN.replace("Dec  2 11:38:47 gpu02 ", f"{stamp} {node} ").replace("0000:07:00", pci)]
    if kind == "xid74_nvlink":
        return [f"{stamp} {node} kernel: " + XID74_MESSAGE.replace("0003:00:00", pci)]
    if kind == "ib_link_flap":
        return [f"{stamp} {node} kernel: {IB_KERNEL_DOWN}"]
    if kind == "ib_link_up":
        return [f"{stamp} {node} kernel: {IB_KERNEL_UP}"]
    raise ValueError(f"no kernel lines for {kind}")


def watchdog_line(rank: int, t: float, seq: int) -> str:
    """One rank's NCCL watchdog timeout (PyTorch ProcessGroupNCCL), without the rank prefix."""
    stamp = datetime.fromtimestamp(t).strftime("%m%d %H:%M:%S.%f")
    text = WATCHDOG_LINE.removeprefix("[rank0]:")
    return (
        text.replace("[E1206 18:44:12.715298746", f"[E{stamp}")
        .replace("[Rank 0]", f"[Rank {rank}]")
        .replace("SeqNum=7753", f"SeqNum={seq}")
    )


def ib_port_error_lines(node: str) -> list[str]:
    return [line.replace("gpu01:", f"{node}:", 1) for line in IB_PORT_ERROR_LINES]


def srun_node_failure_lines(node: str) -> list[str]:
    return [SRUN_NODE_FAILURE.replace("gpu03", node), SRUN_STEP_ABORTED]


def step_cancelled_line(job_id: str, host: str, t: float) -> str:
    stamp = datetime.fromtimestamp(t).strftime("%Y-%m-%dT%H:%M:%S")
    return (
        STEP_CANCELLED_NODE_FAILURE.replace("1943824.0", f"{job_id}.0")
        .replace(" ON gpu01 ", f" ON {host} ")
        .replace("2023-03-06T03:17:51", stamp)
    )


def nccl_init_lines(node: str, index: int) -> list[str]:
    return [
        line.replace("gpu01:", f"{node}:").replace("10.0.0.1<", f"10.0.{index // 250}.{index % 250 + 1}<")
        for line in NCCL_INIT_LINES
    ]


def iteration_line(
    step: int, total: int, ms: float, lr: float, gbs: int, loss: float | None, scale: float, grad_norm: float | None
) -> str:
    """A Megatron-LM iteration line in the format of tests/fixtures/progress/megatron.log."""
    loss_part = f" lm loss: {loss:.6E} |" if loss is not None else ""
    gn = "nan" if grad_norm is None else f"{grad_norm:.3f}"
    return (
        f" iteration {step:8d}/{total:8d} | consumed samples: {step * gbs:12d} | elapsed time per iteration (ms): "
        f"{ms:.1f} | learning rate: {lr:.3E} | global batch size: {gbs:5d} |{loss_part} loss scale: {scale:.1f} | "
        f"grad norm: {gn} | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


def checkpoint_lines(step: int, path: str) -> tuple[str, str]:
    return (
        f"saving checkpoint at iteration {step:7d} to {path}",
        f"  successfully saved checkpoint at iteration {step:7d} to {path}",
    )
