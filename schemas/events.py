"""Every event that crosses a topic.

Times are float seconds since the Unix epoch (UTC): `event_time` is when the
thing happened (as well as the source tells), `produced_at` when our component
published it. Latencies are differences of these.
"""

from __future__ import annotations

import math
import re
import time
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_serializer, model_validator

from schemas.ids import CLUSTER_RE, NODE_NAME_MAX, NODE_NAME_PATTERN, check_node_name, current_cluster
from schemas.vocab import (
    ActionKind,
    Category,
    Guardrail,
    Mode,
    Provenance,
    RejectReason,
    Remediation,
    ResultStatus,
    Role,
    Severity,
    Source,
)

SCHEMA_VERSION = 2


# Upper bound of any event time: 2200-01-01 UTC, inside ClickHouse DateTime64's range
# (to 2299). A time outside [epoch, this] or not finite is a broken clock or a forged
# event; it is refused at decode (dead letter) instead of failing an audit insert later.
MAX_EVENT_TIME = 7_258_118_400.0
Timestamp = Annotated[float, Field(ge=0.0, le=MAX_EVENT_TIME, allow_inf_nan=False)]


# A Slurm node name (schemas.ids: the grammar and where it comes from), in every field of every
# event that names a node: a decoder refuses a forged one (a newline, an ANSI escape, a hostlist's
# comma) naming the field, and the event goes to the dead letters. Checked by pydantic-core's own
# regex (whose `$` is the end of the text, not before a last newline): decoding is the hot path.
NodeName = Annotated[str, Field(min_length=1, max_length=NODE_NAME_MAX, pattern=f"^{NODE_NAME_PATTERN}$")]


def _node_name(value: str) -> str:
    return check_node_name(value)


# The same grammar where a name comes in from outside (the ingest's payloads, the API's requests):
# the refusal also shows the value, its control characters escaped (schemas.ids.check_node_name).
NodeNameInput = Annotated[
    str,
    AfterValidator(_node_name),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": NODE_NAME_MAX, "pattern": f"^{NODE_NAME_PATTERN}$"}),
]


def now() -> float:
    return time.time()


class Event(BaseModel):
    """Fields every event carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type_name: ClassVar[str] = "event"

    schema_version: Literal[2] = 2  # == SCHEMA_VERSION
    event_id: str = Field(min_length=1, max_length=200)
    event_time: Timestamp
    produced_at: Timestamp = Field(default_factory=now)
    # Which cluster the event is about (schemas.ids): the process's own when it makes the event.
    cluster: str = Field(default_factory=current_cluster, max_length=63, pattern=CLUSTER_RE.pattern)


# --- signals -----------------------------------------------------------------


class GpuMetrics(BaseModel):
    """One GPU's readings. None means "not supported or not readable", never 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    uuid: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False  # NVML answered GPU_IS_LOST (or similar) for this GPU
    error: str | None = None
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    throttle_reasons: list[str] | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    pcie_replay_count: int | None = None
    nvlink_errors: int | None = None
    xid_events: list[int] = Field(default_factory=list)


class GpuSample(Event):
    """One record per node per interval, carrying every GPU of the node."""

    type_name: ClassVar[str] = "gpu_sample"
    node: NodeName
    gpus: list[GpuMetrics]
    collector: Literal["nvml", "dcgm", "sim"] = "nvml"


class GpuSampleBatch(Event):
    """GPU samples of the nodes one job runs on, gathered by the streams for that job's partition
    (`gpu.samples.by_job`): one record per job every few seconds instead of one per node. Each
    sample is as its node published it (a version 2 `gpu_sample`)."""

    type_name: ClassVar[str] = "gpu_sample_batch"
    job_id: str = Field(min_length=1, max_length=64)
    samples: list[GpuSample] = Field(min_length=1)


class NetPort(BaseModel):
    """One InfiniBand / RoCE port as the kernel's sysfs shows it (producers/ib_sysfs.py). None means
    "not readable", never 0 or DOWN: a file that could not be read or parsed is named in `error`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(min_length=1, max_length=64)  # e.g. mlx5_0 (/sys/class/infiniband/<device>)
    port: int = Field(ge=0, le=255)  # ports/<port>: 1.. on an HCA, 0 on a switch
    # ports/<n>/link_layer: "InfiniBand", or "Ethernet" for a RoCE port.
    link_layer: str | None = Field(default=None, max_length=32)
    state: str | None = Field(default=None, max_length=32)  # "ACTIVE" of "4: ACTIVE"
    state_code: int | None = None  # 4 of "4: ACTIVE"
    phys_state: str | None = Field(default=None, max_length=64)  # "LinkUp" of "5: LinkUp"
    phys_state_code: int | None = None
    rate: str | None = Field(default=None, max_length=64)  # as read, e.g. "200 Gb/sec (4X HDR)"
    rate_gbps: float | None = None
    # counters/<name> (IB PortCounters through the PMA): every one that read as a number.
    counters: dict[str, int] = Field(default_factory=dict)
    # hw_counters/<name> (optional, driver-defined); None: the port has no hw_counters directory.
    hw_counters: dict[str, int] | None = None
    error: str | None = Field(default=None, max_length=2000)


class NetPortSample(Event):
    """One record per node per interval, carrying every InfiniBand / RoCE port of the node."""

    type_name: ClassVar[str] = "net_port_sample"
    node: NodeName
    ports: list[NetPort]
    collector: Literal["sysfs", "sim"] = "sysfs"


class LogLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(max_length=65536)
    ts: Timestamp  # when the line was written, or first seen by the tailer
    rank: int | None = Field(default=None, ge=0)
    node: NodeName | None = None
    gpu: int | None = Field(default=None, ge=0)  # GPU index on `node`, when the line says
    lineno: int = Field(ge=0)
    # A multi-line Python traceback travels as one line: `text` is its final
    # exception line, `context` the whole traceback.
    context: str | None = Field(default=None, max_length=65536)


class LogBatch(Event):
    """Lines of one job's output, in file order, keyed by job id."""

    type_name: ClassVar[str] = "log_batch"
    job_id: str = Field(min_length=1, max_length=64)
    source: str  # file path or stream name
    job_nodes: list[NodeName] = Field(default_factory=list)
    partition: str | None = None
    lines: list[LogLine]


class KernelEvent(Event):
    """One parsed kernel-log line of interest (Xid, SXid, fallen off the bus)."""

    type_name: ClassVar[str] = "kernel_event"
    node: NodeName
    # How the producer read the line: the kernel's own ring buffer (/dev/kmsg), journald's kernel
    # transport, or a log file (kern.log, syslog), which a local program can also write to. None:
    # an event from before this field, taken as a file (the weaker).
    reader: Literal["kmsg", "journald", "file"] | None = None
    kind: Literal["xid", "sxid", "fallen_off_bus", "other"]
    xid: int | None = None
    pci_bus_id: str | None = None
    gpu_index: int | None = None
    pid: int | None = None
    process_name: str | None = None
    text: str = Field(max_length=65536)


class SchedEvent(Event):
    """A change seen in the scheduler: job state transitions, node state/flags."""

    type_name: ClassVar[str] = "sched_event"
    kind: Literal["job", "node"]
    job_id: str | None = None
    node: NodeName | None = None
    state: str
    previous_state: str | None = None
    nodes: list[NodeName] = Field(default_factory=list)
    partition: str | None = None
    reason: str | None = None
    flags: list[str] = Field(default_factory=list)
    # Who runs the job (kind "job"): what policy rules match on besides partition.
    job_name: str | None = None
    user: str | None = None
    account: str | None = None
    # A node's reason (kind "node"): who set it and when, as Slurm reports them (another
    # remediator's drain - NHC, an admin, NVSentinel - is told from ours by its reason).
    reason_user: str | None = None
    reason_time: Timestamp | None = None
    # The active MAINT reservation holding the node (planned maintenance; flags then has MAINTENANCE).
    reservation: str | None = None
    # How often Slurm has restarted the job (kind "job"; squeue's restart_cnt): policy's restart budget
    # counts it too, so restarts nobody here remembers (a lost broker, an operator's) still count.
    restart_count: int | None = Field(default=None, ge=0)
    # The job's Comment (kind "job"; sbatch --comment): where a job's owner sets trainmedic=...
    # for it (streams/policy.py JobSettings), and where the executor leaves its mark beside it.
    comment: str | None = Field(default=None, max_length=4096)


#: How trainmedic's own drain reasons start (streams/policy.make_action): "trainmedic inc-...: category".
DRAIN_REASON_RE = re.compile(r"^trainmedic (inc-[0-9A-Za-z_-]+)")


def incident_in_reason(reason: str | None) -> str | None:
    """The incident id of a drain reason trainmedic wrote; None for anyone else's reason."""
    m = DRAIN_REASON_RE.match(reason or "")
    return m.group(1) if m else None


class ProgressSample(BaseModel):
    """One training-progress report parsed from a log line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ts: Timestamp  # when the line was written (or first seen)
    rank: int | None = Field(default=None, ge=0)
    node: NodeName | None = None
    step: int | None = Field(default=None, ge=0)
    step_time_s: float | None = Field(default=None, ge=0)
    loss: float | None = None  # NaN/inf are kept: a diverged loss is a signal
    grad_norm: float | None = None
    tokens_per_s: float | None = Field(default=None, ge=0)
    # "train" for an ordinary step, "checkpoint" while a checkpoint is being saved
    # (a hang detector must not fire then), "eval" for evaluation passes.
    phase: Literal["train", "checkpoint", "eval"] = "train"
    format: str  # which parser recognised it: megatron, lightning, hf, torchtitan, deepspeed, custom

    @field_serializer("loss", "grad_norm", when_used="json")
    def _non_finite_as_text(self, value: float | None) -> float | str | None:
        # JSON has no NaN/inf and orjson would write null ("no loss reported"), losing
        # exactly the signal the numerical detector needs; the decoder reads these back.
        if value is None or math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


class ProgressBatch(Event):
    """Progress reports of one job, in log order, keyed by job id."""

    type_name: ClassVar[str] = "progress_batch"
    job_id: str = Field(min_length=1, max_length=64)
    job_nodes: list[NodeName] = Field(default_factory=list)
    partition: str | None = None
    samples: list[ProgressSample]


class HealthEvent(Event):
    """A health verdict from another monitor (NVSentinel HealthEvent, NVRx report)."""

    type_name: ClassVar[str] = "health_event"
    origin: Literal["nvsentinel", "nvrx"]
    node: NodeName
    check_name: str
    component: str | None = None  # e.g. GPU, NVSwitch, NIC
    component_ids: list[str] = Field(default_factory=list)
    error_codes: list[str] = Field(default_factory=list)
    is_fatal: bool = False
    is_healthy: bool = False
    recommended_action: str | None = None
    message: str = Field(default="", max_length=65536)
    job_id: str | None = None
    rank: int | None = None
    # How the ingest server authenticated the report (producers/ingest_auth.py): "service" (a
    # cluster service's own credential), "job" (a MUNGE credential or per-job token shown to
    # come from the job it names), "shared" (the shared ingest token, allowed for jobs only by
    # ingest_allow_shared_token_for_jobs); None: not stated (events from before it existed).
    authenticated_as: Literal["service", "job", "shared"] | None = None


# --- what the streams conclude ---------------------------------------------------


def default_provenance(source: str | None, origin: str | None = None) -> Provenance:
    """The provenance of evidence published before it carried one, from its `source`: a kernel
    line of unknown reader ranks as a file's, an external report as a job's unless it came from
    NVSentinel (the ingest endpoint's service)."""
    if source == "kernel":
        return "kernel_file"
    if source == "gpu":
        return "gpu"
    if source == "net":
        return "net"
    if source == "scheduler":
        return "scheduler"
    if source == "external" and origin == "nvsentinel":
        return "service"
    return "job"


def kernel_provenance(event: KernelEvent) -> Provenance:
    """A kernel line from the kernel's ring buffer or journald's kernel transport is the kernel's;
    one from a log file (or from an event that does not say) ranks below it."""
    return "kernel" if event.reader in ("kmsg", "journald") else "kernel_file"


def external_provenance(event: HealthEvent) -> Provenance:
    """The provenance of an ingested health report, from who the ingest authenticated
    (producers/ingest_auth.py): a service credential is `service`; a job's credential (MUNGE, a
    per-job token) is `job`, and so is the shared token where jobs may hold it. An event from before
    the ingest said (`authenticated_as` None) falls back to the origin its body names."""
    if event.authenticated_as == "service":
        return "service"
    if event.authenticated_as in ("job", "shared"):
        return "job"
    return "service" if event.origin == "nvsentinel" else "job"


def _with_provenance(data: object) -> object:
    if isinstance(data, dict) and data.get("provenance") is None and "source" in data:
        facts = data.get("facts")
        origin = facts.get("origin") if isinstance(facts, dict) else None
        return {**data, "provenance": default_provenance(data.get("source"), origin)}
    return data


class RankActivity(BaseModel):
    """What another rank of the job was last seen doing (rank-local work such as a
    checkpoint save or validation, or having finished training) when a collective
    timed out: the context that tells a timeout's cause from its symptom."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int | None = None
    node: NodeName | None = None
    activity: str = Field(min_length=1, max_length=64)  # an id of streams/catalog/activities.yaml
    time: Timestamp
    line: str = Field(default="", max_length=512)


class Anomaly(Event):
    """One detector hit: a signal that something may be wrong."""

    type_name: ClassVar[str] = "anomaly"
    detector: str
    signature: str  # catalog entry id, e.g. "nccl_watchdog_timeout", "xid_79"
    category: Category
    severity: Severity
    role: Role
    isolate: bool = False  # the fault lives on `node`: drain it before a restart
    source: Source
    # Who could have written the evidence (schemas/vocab.py Provenance): what policy lets it trigger.
    # Events without it (older producers) get it from `source` (default_provenance).
    provenance: Provenance = "job"
    job_id: str | None = None
    node: NodeName | None = None
    rank: int | None = None
    partition: str | None = None
    job_nodes: list[NodeName] = Field(default_factory=list)
    line: str = Field(default="", max_length=4096)
    meaning: str = ""
    gpu: int | None = Field(default=None, ge=0)  # GPU index on `node`, when the signal names it
    # Values the signature read out of the line (named groups), e.g. a collective's
    # timeout_ms, seq and op: what attribution reasons with besides the category.
    facts: dict[str, str] = Field(default_factory=dict)
    # For collateral signals (collective timeouts): what the job's other ranks were last doing.
    activity: list[RankActivity] = Field(default_factory=list, max_length=64)

    _fill_provenance = model_validator(mode="before")(_with_provenance)


class Evidence(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Source
    provenance: Provenance = "job"
    signature: str
    node: NodeName | None = None
    rank: int | None = None
    time: Timestamp
    line: str
    role: Role
    gpu: int | None = None

    _fill_provenance = model_validator(mode="before")(_with_provenance)


class Incident(Event):
    """Attribution: one job's anomalies within a window, grouped and explained."""

    type_name: ClassVar[str] = "incident"
    incident_id: str
    job_id: str | None = None
    partition: str | None = None
    job_nodes: list[NodeName] = Field(default_factory=list)
    job_name: str | None = None  # from the scheduler's job state, when one was seen
    job_restarts: int | None = Field(default=None, ge=0)  # Slurm's restart count of the job, when seen
    user: str | None = None
    account: str | None = None
    job_comment: str | None = Field(default=None, max_length=4096)  # the job's Comment, when seen
    # A fleet incident (streams/fleet.py): the shared component whose nodes failed together
    # ("switch:leaf3", a rack), and all its nodes; None for a job's incident.
    domain: str | None = Field(default=None, max_length=256)
    domain_nodes: list[NodeName] = Field(default_factory=list)
    # The domain's nodes whose own incidents made the fleet incident: they keep those drains (their
    # way back needs a health check); a drain set takes only the others (streams/policy.py).
    domain_failed_nodes: list[NodeName] = Field(default_factory=list)
    category: Category
    severity: Severity
    culprit_node: NodeName | None = None
    culprit_rank: int | None = None
    culprit_gpu: int | None = None  # GPU index on the culprit node, when the evidence names it
    confidence: float = Field(ge=0.0, le=1.0)
    # Facts only: which action they call for is policy's (streams.policy.choose_action).
    # The fault lives on the culprit's node (the deciding signal's catalog `isolate`, or the same
    # error on several ranks of one node): a restart must take that node out first.
    isolate: bool = False
    # The culprit node against the scheduler's placement of the job: True one of its nodes,
    # False not one of them (a job's output named a foreign node), None placement unknown.
    culprit_in_job: bool | None = None
    # Whether isolating the culprit may be carried out (streams.policy.isolation: a node of the
    # job per the scheduler, or the node whose own kernel/GPU reported the fault), and why not;
    # stated where `isolate` is.
    isolatable: bool = False
    isolation_note: str = Field(default="", max_length=1024)
    # The strongest provenance among the deciding (root) evidence; None: an incident from before
    # provenance was carried.
    provenance: Provenance | None = None
    explanation: str
    evidence: list[Evidence]
    anomaly_ids: list[str]
    first_signal_time: Timestamp  # earliest evidence: the start of detection latency
    # reactive: a fault that happened (attribution); predicted: a pre-failure verdict about a GPU
    # of one of the job's nodes (streams/migration.py), whose answer is a migration at the job's
    # next checkpoint, not a restart now.
    kind: Literal["reactive", "predicted"] = "reactive"


class Decision(Event):
    """What policy made of an incident: a recommendation, or an action to take."""

    type_name: ClassVar[str] = "decision"
    decision_id: str
    incident_id: str
    job_id: str | None = None
    partition: str | None = None
    category: Category
    culprit_node: NodeName | None = None
    culprit_rank: int | None = None
    culprit_gpu: int | None = None
    action: ActionKind
    mode: Mode
    executed: bool  # True: an action event was emitted; False: recommendation only
    stop_mode: Literal["cancel", "hold"] = "cancel"  # how `stop` stops: cancel, or hold for a human
    # After the drain: a reboot or a repair label, by the fault's resolution bucket (policy `remediation`).
    remediation: Remediation | None = None
    remediation_bucket: str | None = Field(default=None, max_length=64)
    rule: str
    reason: str
    first_signal_time: Timestamp
    incident_time: Timestamp


class Action(Event):
    """An instruction to the executor. `action_id` is stable per incident and step."""

    type_name: ClassVar[str] = "action"
    action_id: str
    decision_id: str
    incident_id: str
    job_id: str | None = None
    node: NodeName | None = None
    # A drain set (a fleet incident's shared component, streams/fleet.py): every node of it taken
    # out as one, under the guardrails as a whole; `node` is then None.
    nodes: list[NodeName] = Field(default_factory=list, max_length=10_000)
    partition: str | None = None
    action: ActionKind
    stop_mode: Literal["cancel", "hold"] = "cancel"
    remediation: Remediation | None = None  # after the drain (the decision's)
    remediation_bucket: str | None = Field(default=None, max_length=64)
    culprit_gpu: int | None = None  # the decision's: which GPU a reset_gpu remediation resets
    reason: str
    requested_by: str
    incident_time: Timestamp
    first_signal_time: Timestamp
    # True when `node`'s own kernel/GPU/health monitor reported the fault (root evidence from
    # the node itself). Otherwise the executor drains `node` for a job only if the scheduler
    # says the job runs there: a job's output may not take another job's node out of service.
    node_reported_fault: bool = False
    # True when the incident's evidence is the scheduler reporting `node` DOWN or NOT_RESPONDING:
    # the executor then drains a node Slurm failed itself (so it stays out when its slurmd answers
    # again), and needs no placement: Slurm may already have requeued the job off the node.
    node_failed: bool = False
    # A requeue that keeps the job off `node`: the job's own evidence blamed it, which may restart
    # the job but not isolate the node (streams/policy.py, "job evidence only"); or a migration's
    # requeue off the node it drained (streams/migration.py).
    exclude_node: bool = False
    # A drain for a predicted failure (a migration): counted against the guardrails' cap on
    # predictive drains, never against the drains reactive incidents need (sinks/guardrails.py).
    predicted: bool = False


# Scheduler calls that may change the cluster, as recorded before they are made.
# reset_gpu: the command to the node's agent (sinks/node_agent.py) is published, not a Slurm call, but
# it is recorded and counted the same way before it is made.
# signal: a job asked for a checkpoint before a migration (the signal its comment declares).
AttemptCall = Literal["drain", "requeue", "cancel", "hold", "reboot", "relabel", "reset_gpu", "signal"]


class ActionAttempt(Event):
    """A scheduler call the executor is about to make, written (acks=all, flushed) before it.

    Guardrails count these, not results: a call that was sent may have taken effect whatever
    happened after it (a requeue that failed, a verification that timed out, a crash).
    """

    type_name: ClassVar[str] = "action_attempt"
    action_id: str
    incident_id: str
    job_id: str | None = None
    node: NodeName | None = None
    partition: str | None = None
    action: ActionKind
    call: AttemptCall
    executor: str = Field(min_length=1, max_length=200)  # the replica (client id) that held the lease
    predicted: bool = False  # the action's: which drain cap the call counts against


class ActionResult(Event):
    """What the executor did and what it read back from the scheduler."""

    type_name: ClassVar[str] = "action_result"
    action_id: str
    incident_id: str
    job_id: str | None = None
    node: NodeName | None = None
    action: ActionKind
    status: ResultStatus
    backend: str
    steps: list[str]
    error: str | None = None
    started_at: Timestamp
    verified_at: Timestamp | None = None
    incident_time: Timestamp
    first_signal_time: Timestamp


class Approval(Event):
    """An operator's verdict on a recommendation (monitor mode)."""

    type_name: ClassVar[str] = "approval"
    approval_id: str
    decision_id: str
    incident_id: str
    job_id: str | None = None
    partition: str | None = None
    category: Category
    action: ActionKind
    # approved/rejected: an answer to a recommendation; confirmed: a label given after
    # the fact that the fault was real (e.g. the node failed its diagnostics, RMA).
    verdict: Literal["approved", "rejected", "confirmed"]
    reason: RejectReason | None = None  # required when rejected
    comment: str = Field(default="", max_length=4096)
    operator: str = Field(min_length=1, max_length=128)


class ModeChange(Event):
    """Autonomy switched for a partition (and optionally one category)."""

    type_name: ClassVar[str] = "mode_change"
    partition: str | None = None  # None: the default for every partition
    category: Category | None = None  # None: every category
    old_mode: Mode | None = None
    new_mode: Mode
    operator: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=4096)
    forced: bool = False  # applied although the readiness verdict said "not yet"
    outcome: Literal["applied", "refused"] = "applied"
    readiness: str = Field(default="", max_length=4096)  # the readiness verdict at the time, in words


class NodeReturn(Event):
    """An operator returned a node that trainmedic drained to service."""

    type_name: ClassVar[str] = "node_return"
    node: NodeName
    incident_id: str | None = None  # the incident named in the drain reason
    drain_reason: str
    operator: str = Field(min_length=1, max_length=128)
    comment: str = Field(default="", max_length=4096)
    # Refused returns are recorded too: a lemon, a failed or missing health check. recommended: the
    # automatic path judged the node fit but did not resume it (monitor mode, the kill switch).
    outcome: Literal["resumed", "refused", "recommended"] = "resumed"
    check: str | None = Field(default=None, max_length=4096)  # the health check as run
    check_passed: bool | None = None  # None: no check ran
    detail: str = Field(default="", max_length=8192)  # why refused; the check's output tail


class GuardrailTrip(Event):
    """The executor refused an action because a guardrail stopped it."""

    type_name: ClassVar[str] = "guardrail_trip"
    guardrail: Guardrail
    action_id: str
    incident_id: str
    job_id: str | None = None
    node: NodeName | None = None
    partition: str | None = None
    action: ActionKind
    detail: str


class DeadLetter(Event):
    """A message a component could not accept, with the reason and the original bytes."""

    type_name: ClassVar[str] = "dead_letter"
    component: str
    original_topic: str
    original_partition: int | None = None
    original_offset: int | None = None
    reason: str
    payload_b64: str


class JobAttempt(Event):
    """One run of a job in its lineage (streams/lineage.py): the first run, then one per restart.

    Published when the attempt starts, when policy orders the restart that ends it (its cause),
    and when it ends; the audit keeps the latest of each (lineage id, attempt)."""

    type_name: ClassVar[str] = "job_attempt"
    lineage_id: str = Field(min_length=1, max_length=128)  # cluster + job id + first seen
    job_id: str = Field(min_length=1, max_length=64)
    job_name: str | None = None
    user: str | None = None
    first_seen: Timestamp
    attempt: int = Field(ge=1)
    restart_count: int = Field(ge=0)  # Slurm's restart count when the attempt started
    started_at: Timestamp
    ended_at: Timestamp | None = None
    end_reason: str | None = Field(default=None, max_length=256)
    cause_incident_id: str | None = None  # the incident policy restarted the job for
    cause_category: Category | None = None
    cause_node: NodeName | None = None
    excluded_nodes: list[NodeName] = Field(default_factory=list)  # excluded so far in the lineage
    # Progress: the lineage's best step and last checkpoint before the attempt, the attempt's own
    # best step, and whether it saved a checkpoint beyond the last one.
    start_step: int | None = Field(default=None, ge=0)
    start_checkpoint: int | None = Field(default=None, ge=0)
    max_step: int | None = Field(default=None, ge=0)
    new_checkpoint: bool = False
    # True: a higher step or a new checkpoint; False: neither; None: not judged yet (the attempt
    # runs) or unknown (the job never reported progress).
    progressed: bool | None = None


MigrationState = Literal["waiting", "requeued", "fell_back", "superseded", "ended", "cancelled"]


class Migration(Event):
    """One state of a checkpoint-aligned migration (streams/migration.py): a job moved off a node
    with a pre-failure verdict at its next completed checkpoint. `waiting`: the node is drained,
    the job runs on until it saves a checkpoint beyond `checkpoint_before` or `deadline` passes;
    then `requeued` (off the node), `fell_back` (no checkpoint in time: the reactive path stays),
    `superseded` (the node failed first: the reactive incident acts), `ended` (the job ended), or
    `cancelled` (by an operator, who resumes the node). The latest record of a migration is its state."""

    type_name: ClassVar[str] = "migration"
    migration_id: str = Field(min_length=1, max_length=200)
    incident_id: str
    decision_id: str
    job_id: str = Field(min_length=1, max_length=64)
    node: NodeName
    gpu: int | None = Field(default=None, ge=0)
    rule: str = Field(max_length=128)  # the pre-failure rule that raised the verdict
    state: MigrationState
    decided_at: Timestamp
    deadline: Timestamp
    # The job's last completed checkpoint when the migration began (None: none seen), and the one
    # that ended the wait.
    checkpoint_before: int | None = Field(default=None, ge=0)
    checkpoint_step: int | None = Field(default=None, ge=0)
    requested_by: str = Field(min_length=1, max_length=128)  # "policy", or the operator who cancelled
    detail: str = Field(default="", max_length=4096)


NodeCommandKind = Literal["gpu_reset"]


class NodeCommand(Event):
    """An instruction to the node agent of one node (sinks/node_agent.py), published by the executor
    once the node is drained for its own fault. `command_id` is stable per action: a redelivered
    action publishes the same command again, and the agent carries each command id out once."""

    type_name: ClassVar[str] = "node_command"
    command_id: str = Field(min_length=1, max_length=200)
    node: NodeName
    kind: NodeCommandKind
    gpu: int | None = Field(default=None, ge=0)  # the GPU's index on the node (NVML's); None: every GPU
    action_id: str
    incident_id: str
    reason: str = Field(max_length=4096)  # the drain reason the executor set
    requested_by: str
    issued_at: Timestamp


class NodeCommandResult(Event):
    """What the node agent made of a command. It repeats the command's action and incident, so that
    one record answers "was the reset of node X for incident Y done, and when"."""

    type_name: ClassVar[str] = "node_command_result"
    command_id: str = Field(min_length=1, max_length=200)
    node: NodeName
    kind: NodeCommandKind
    gpu: int | None = Field(default=None, ge=0)
    action_id: str
    incident_id: str
    # done: carried out and verified; failed: carried out (or begun) but not verified; refused: not
    # carried out (the node was busy past the idle timeout, or no longer drained for the incident).
    status: Literal["done", "failed", "refused"]
    detail: str = Field(default="", max_length=8192)  # why; the command's output tail
    agent: str = Field(min_length=1, max_length=200)  # the host the agent runs on
    started_at: Timestamp
    finished_at: Timestamp


EVENT_TYPES: tuple[type[Event], ...] = (
    GpuSample,
    GpuSampleBatch,
    NetPortSample,
    LogBatch,
    ProgressBatch,
    HealthEvent,
    KernelEvent,
    SchedEvent,
    Anomaly,
    Incident,
    Decision,
    Action,
    ActionAttempt,
    ActionResult,
    Approval,
    ModeChange,
    NodeReturn,
    GuardrailTrip,
    DeadLetter,
    JobAttempt,
    NodeCommand,
    NodeCommandResult,
    Migration,
)
