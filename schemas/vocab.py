"""Shared vocabularies: used verbatim by code, CLI, audit tables and docs."""

from __future__ import annotations

from typing import Literal, get_args

Category = Literal[
    "gpu_hardware",
    "interconnect",
    "hang",
    "user_code",
    "oom",
    "numerical",
    "storage",
    "node",
    # A crash was seen (non-zero exit, traceback, Killed, a signal) but no known cause:
    # "needs a person". Never triggers an action (the policy refuses to map it to one).
    "unknown",
    "healthy",
]
# drain: the node only, the job left alone - a hardware fault endangers every job the node would
# get next, but the job's owner said trainmedic must not touch the job (streams/policy.py JobSettings).
# drain_and_stop: the restart budget (or the no-progress limit) stops a job whose node has a fault
# of its own: the node is still taken out, for the next job's sake.
ActionKind = Literal["drain_and_requeue", "requeue", "stop", "drain", "drain_and_stop", "none"]
# What follows a drain for the node's fault, by its NVIDIA resolution bucket (streams/policy.py):
# reboot: `scontrol reboot ASAP` (the node comes back drained); repair: relabelled for a person;
# reset_gpu: the node agent on the node resets the GPU once the node is idle (sinks/node_agent.py).
Remediation = Literal["reboot", "repair", "reset_gpu"]
#: The actions that take a node out of service.
DRAINS: tuple[ActionKind, ...] = ("drain_and_requeue", "drain", "drain_and_stop")
#: The actions that stop the job.
STOPS: tuple[ActionKind, ...] = ("stop", "drain_and_stop")
Mode = Literal["monitor", "autonomous"]
Severity = Literal["info", "warning", "error", "critical"]
# root: the signal names its own origin as the likely cause (Xid 79 on that node);
# collateral: the signal is a symptom seen on ranks that merely waited on the culprit.
Role = Literal["root", "collateral"]
# net: the node's own InfiniBand / RoCE port readings (producers/ib_sysfs.py), as gpu is its own GPU telemetry.
Source = Literal["job_log", "kernel", "scheduler", "gpu", "external", "net"]
# Who could have written a piece of evidence (docs/security.md "Provenance"): what policy may let
# it trigger. kernel: the node's kernel ring buffer read from /dev/kmsg or journald's kernel
# transport; kernel_file: a kernel line read from a log file (kern.log, syslog, messages), ranked
# below kernel since a local program can write a look-alike line there; gpu: NVML or
# dcgm-exporter on the node; net: the node's own InfiniBand/RoCE port state and counters (sysfs);
# scheduler: Slurm's own state (squeue/sinfo); service: an
# authenticated cluster service (NVSentinel); job: the job's output or an in-job reporter (NVRx),
# written with the job owner's rights.
Provenance = Literal["kernel", "kernel_file", "gpu", "net", "scheduler", "service", "job"]
PROVENANCES: tuple[str, ...] = ("kernel", "kernel_file", "gpu", "net", "scheduler", "service", "job")
#: How strong a provenance is: later evidence of a higher rank reopens a judgement made on a lower
#: one (streams/attribution.py). job < kernel_file < the rest.
PROVENANCE_RANK: dict[str, int] = {
    "job": 0,
    "kernel_file": 1,
    "kernel": 2,
    "gpu": 2,
    "net": 2,
    "scheduler": 2,
    "service": 2,
}
#: Provenances that may isolate a node on their own by default (policy `provenance.node_evidence`).
NODE_EVIDENCE: tuple[Provenance, ...] = ("kernel", "kernel_file", "gpu", "net", "scheduler", "service")
ResultStatus = Literal["done", "failed", "skipped"]
# Why an operator rejected a recommendation: a short fixed list, so it can be scored.
RejectReason = Literal["wrong_node", "wrong_category", "not_a_fault", "not_worth_acting", "other"]
Guardrail = Literal[
    "kill_switch",
    "partition_not_allowed",
    "blast_radius",
    # No longer tripped: the per-job restart budget is the policy's (streams/policy.py), which
    # stops the job instead. Kept so that trips recorded before (topics, audit) still decode.
    "restart_budget",
    "node_cooldown",
    # The node to drain is not one of the job's nodes per the scheduler (or they cannot be read).
    "culprit_not_in_job",
]

CATEGORIES: tuple[str, ...] = get_args(Category)
ACTIONS: tuple[str, ...] = get_args(ActionKind)
MODES: tuple[str, ...] = get_args(Mode)
REJECT_REASONS: tuple[str, ...] = get_args(RejectReason)
GUARDRAILS: tuple[str, ...] = get_args(Guardrail)
SEVERITIES: tuple[str, ...] = get_args(Severity)
SEVERITY_RANK = {name: i for i, name in enumerate(SEVERITIES)}
# Categories no policy may act on: nothing is wrong, or nobody knows what is. Readiness
# scores neither (there is no autonomy to earn for them).
NEVER_ACTS: tuple[str, ...] = ("unknown", "healthy")
