"""Topic names and partition keys: defined here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import (
    Action,
    ActionAttempt,
    ActionResult,
    Anomaly,
    Approval,
    DeadLetter,
    Decision,
    Event,
    GpuSample,
    GpuSampleBatch,
    GuardrailTrip,
    HealthEvent,
    Incident,
    JobAttempt,
    KernelEvent,
    LogBatch,
    Migration,
    ModeChange,
    NetPortSample,
    NodeCommand,
    NodeCommandResult,
    NodeReturn,
    ProgressBatch,
    SchedEvent,
)


@dataclass(frozen=True)
class Topic:
    name: str
    event_type: type[Event]
    key_doc: str
    # A repartition topic: each record is keyed by the job the streams' router chose for it (the
    # job running on the event's node), not by the event's own partition key.
    keyed_by_router: bool = False
    # Retention -1 instead of the setting topic_retention_hours (bus/admin.py): a worker rebuilds
    # its state from the whole topic.
    kept_forever: bool = False


GPU_SAMPLES = Topic("gpu.samples", GpuSample, "node")
NODE_KERNEL = Topic("node.kernel", KernelEvent, "node")
# InfiniBand / RoCE port state and error counters from the node's sysfs (producers/ib_sysfs.py).
NET_PORTS = Topic("net.ports", NetPortSample, "node")
JOB_LOGS = Topic("job.logs", LogBatch, "job id")
JOB_PROGRESS = Topic("job.progress", ProgressBatch, "job id")
HEALTH_EXTERNAL = Topic("health.external", HealthEvent, "node")
SCHED_EVENTS = Topic("sched.events", SchedEvent, "job id, else node")
ANOMALIES = Topic("anomalies", Anomaly, "job id, else node")
# Repartition topics of the streams (streams/app.py): node-level evidence re-keyed to each job
# running on its node (streams/placement.py), so that one worker judges all of a job's evidence.
ANOMALIES_BY_JOB = Topic(
    "anomalies.by_job", Anomaly, "job id running on the anomaly's node, else node", keyed_by_router=True
)
# A job's GPU samples, gathered for a few seconds (streams/gpu_batches.py): one record per job, not per node.
GPU_SAMPLES_BY_JOB = Topic(
    "gpu.samples.by_job", GpuSampleBatch, "job id running on the samples' nodes", keyed_by_router=True
)
INCIDENTS = Topic("incidents", Incident, "job id, else node")
# A node's incident, once per topology domain of its node (streams/fleet.py), keyed by the domain.
INCIDENTS_BY_DOMAIN = Topic(
    "incidents.by_domain", Incident, "topology domain of the culprit node", keyed_by_router=True
)
DECISIONS = Topic("decisions", Decision, "job id, else node")
ACTIONS = Topic("actions", Action, "job id, else node")
ACTION_RESULTS = Topic("action.results", ActionResult, "job id, else node")
# One ordered log on one partition (ATTEMPTS_PARTITION), whatever the topic's partition count:
# the guardrails' count is read back from it in order, and that partition is the executor's
# lease (the replica its lease group assigns it to is the one replica that acts).
ACTION_ATTEMPTS = Topic("action.attempts", ActionAttempt, "action id; every record on partition 0")
ATTEMPTS_PARTITION = 0
APPROVALS = Topic("approvals", Approval, "job id, else node")
MODE_CHANGES = Topic("mode.changes", ModeChange, "partition", kept_forever=True)
NODE_RETURNS = Topic("node.returns", NodeReturn, "node")
GUARDRAIL_TRIPS = Topic("guardrail.trips", GuardrailTrip, "job id, else node")
DEADLETTER = Topic("deadletter", DeadLetter, "original topic")
JOB_ATTEMPTS = Topic("job.attempts", JobAttempt, "job id")
# The executor's commands to the node agents (sinks/node_agent.py), and what each agent made of them:
# keyed by node, so one node's commands and results stay in order.
NODE_COMMANDS = Topic("node.commands", NodeCommand, "node")
NODE_COMMAND_RESULTS = Topic("node.command.results", NodeCommandResult, "node")
# Checkpoint-aligned migrations (streams/migration.py): each state change, and an operator's cancel.
MIGRATIONS = Topic("migrations", Migration, "job id")

ALL_TOPICS: tuple[Topic, ...] = (
    GPU_SAMPLES,
    NODE_KERNEL,
    NET_PORTS,
    JOB_LOGS,
    JOB_PROGRESS,
    SCHED_EVENTS,
    HEALTH_EXTERNAL,
    ANOMALIES,
    ANOMALIES_BY_JOB,
    GPU_SAMPLES_BY_JOB,
    INCIDENTS,
    INCIDENTS_BY_DOMAIN,
    DECISIONS,
    ACTIONS,
    ACTION_RESULTS,
    ACTION_ATTEMPTS,
    APPROVALS,
    MODE_CHANGES,
    NODE_RETURNS,
    GUARDRAIL_TRIPS,
    DEADLETTER,
    JOB_ATTEMPTS,
    NODE_COMMANDS,
    NODE_COMMAND_RESULTS,
    MIGRATIONS,
)
TOPIC_BY_NAME = {t.name: t for t in ALL_TOPICS}
INPUT_TOPICS = (GPU_SAMPLES, NODE_KERNEL, NET_PORTS, JOB_LOGS, JOB_PROGRESS, SCHED_EVENTS, HEALTH_EXTERNAL)
DEFAULT_PARTITIONS = 12


def fixed_partition(topic: Topic) -> int | None:
    """The partition every record of `topic` goes to, for the topics that have one; else None (by key)."""
    return ATTEMPTS_PARTITION if topic is ACTION_ATTEMPTS else None


def partition_key(event: Event) -> bytes:
    """The partition key of an event: job id when one is known, else node.

    One job's evidence must land on one partition, in order, for attribution.
    """
    if isinstance(
        event, (GpuSample, KernelEvent, NetPortSample, HealthEvent, NodeReturn, NodeCommand, NodeCommandResult)
    ):
        return event.node.encode()
    if isinstance(event, (LogBatch, ProgressBatch)):
        return event.job_id.encode()
    if isinstance(event, DeadLetter):
        return event.original_topic.encode()
    if isinstance(event, ModeChange):
        return (event.partition or "*").encode()
    if isinstance(event, ActionAttempt):
        return event.action_id.encode()  # informative only: produced to ATTEMPTS_PARTITION
    job_id = getattr(event, "job_id", None)
    if job_id:
        return str(job_id).encode()
    node = getattr(event, "node", None) or getattr(event, "culprit_node", None)
    if node:
        return str(node).encode()
    return event.event_id.encode()
