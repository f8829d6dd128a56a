"""Policy: what to do about an incident, and whether to do it or only recommend.

Attribution states facts (category, culprit, confidence, evidence, whether the
fault lives on the culprit's node and whether isolating it may be carried out);
the action is chosen here alone (`choose_action`, then rules, isolation, the
restart budget and modes in `decide`). The policy is a YAML file (default:
streams/policies/default.yaml, package data) validated at load; errors name the file, the line
and the field.
"""

from __future__ import annotations

import fnmatch
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.errors import ConfigError
from schemas.events import Action, Decision, Evidence, Incident
from schemas.ids import stable_id
from schemas.job_settings import Effective, JobSetting, JobSettingError, from_comment, merge, parse_value
from schemas.vocab import (
    CATEGORIES,
    DRAINS,
    NEVER_ACTS,
    NODE_EVIDENCE,
    PROVENANCE_RANK,
    SEVERITY_RANK,
    STOPS,
    ActionKind,
    Category,
    Mode,
    Provenance,
    Remediation,
    Severity,
)
from schemas.yamlsafe import FILE_LIMITS, YamlError, YamlLimits, compose_yaml, construct_yaml, line_of, load_yaml
from slurmio.hostlist import HostlistError, expand_hostlist
from streams.lineage import RestartHistory, root_signature


def _default_policy() -> Path:
    # Read from the installed package, so a wheel works outside the checkout; callers (the chart's
    # mirror test, GuardrailFile, PolicyStore) take a filesystem path, which a zipped install has not.
    path = resources.files("streams.policies") / "default.yaml"
    if not isinstance(path, Path):
        raise ImportError(f"streams.policies is not installed as files on disk ({path!r}): install trainmedic unzipped")
    return path


DEFAULT_POLICY = _default_policy()


class PolicyError(ConfigError, ValueError):
    pass


class PartitionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None
    categories: dict[Category, Mode] = Field(default_factory=dict)


class ReadinessSettings(BaseModel):
    """When a category is ready for autonomy (trainmedic readiness, mode set gating)."""

    model_config = ConfigDict(extra="forbid")

    min_samples: int = Field(default=10, ge=1)  # decided recommendations needed
    min_precision: float = Field(default=0.9, ge=0.0, le=1.0)  # (approved + confirmed) / decided
    expire_after_h: float = Field(default=24.0, gt=0)  # unanswered longer: expired
    recommend_only: list[Category] = Field(default_factory=list)  # never autonomous
    # Drain reasons (shell globs, case-insensitive) that mean planned maintenance: such a drain
    # by someone else is no readiness miss.
    maintenance_reasons: list[str] = Field(
        default_factory=lambda: ["maint*", "maintenance*", "reboot*", "upgrade*"], max_length=64
    )


class JobMatch(BaseModel):
    """Every given condition must hold. Partition, job name, user and account are
    shell-style globs; an incident whose job owner is unknown (no scheduler state
    seen for it) does not match a rule that asks for one."""

    model_config = ConfigDict(extra="forbid")

    partition: str | None = None
    job_name: str | None = None
    user: str | None = None
    account: str | None = None

    def matches(self, incident: Incident) -> bool:
        for pattern, value in (
            (self.partition, incident.partition),
            (self.job_name, incident.job_name),
            (self.user, incident.user),
            (self.account, incident.account),
        ):
            if pattern is not None and not fnmatch.fnmatchcase(value or "", pattern):
                return False
        return True


class RuleMatch(JobMatch):
    """The job's conditions (JobMatch), and the incident's."""

    category: list[Category] | None = None
    min_severity: Severity | None = None
    min_confidence: float | None = Field(default=None, ge=0.0, le=1.0)
    culprit_known: bool | None = None

    def matches(self, incident: Incident) -> bool:
        if self.category is not None and incident.category not in self.category:
            return False
        if not super().matches(incident):
            return False
        if self.min_severity is not None and SEVERITY_RANK[incident.severity] < SEVERITY_RANK[self.min_severity]:
            return False
        if self.min_confidence is not None and incident.confidence < self.min_confidence:
            return False
        return self.culprit_known is None or (incident.culprit_node is not None) == self.culprit_known


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    match: RuleMatch = Field(default_factory=RuleMatch)
    action: ActionKind
    stop: Literal["cancel", "hold"] = "cancel"


class RestartBudget(BaseModel):
    """After this many restarts of one job in the window, stop it and escalate instead."""

    model_config = ConfigDict(extra="forbid")

    max_restarts: int = Field(default=3, ge=1)
    window_h: float = Field(default=6.0, gt=0)
    # Restarts in a row after which the job made no progress (no higher step, no new checkpoint;
    # streams/lineage.py): at this many, the next restart is not made - stop and escalate.
    no_progress_limit: int = Field(default=3, ge=1)
    then: Literal["stop"] = "stop"
    stop: Literal["cancel", "hold"] = "hold"


# NVIDIA's resolution buckets (streams/catalog/xid.yaml) and what follows the drain for each.
_REMEDIATIONS: dict[str, Remediation] = {
    "RESTART_BM": "reboot",
    "WORKFLOW_NVLINK_ERR": "reboot",
    "RESET_GPU": "reset_gpu",
    "WORKFLOW_XID_48": "repair",
    "CONTACT_SUPPORT": "repair",
    "CHECK_MECHANICALS": "repair",
    "UPDATE_SWFW": "repair",
}


class RemediationPolicy(BaseModel):
    """After trainmedic drains a node for its own fault: what the fault's resolution bucket calls for.
    reboot: `scontrol reboot ASAP` with the node kept out of service after it (it returns through
    `nodes resume` and its health check); reset_gpu: a command to the node agent on that node, which
    resets the GPU once no process uses it (the node stays drained until its health check passes);
    repair: the drain reason says what a person must do."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    buckets: dict[str, Remediation] = Field(default_factory=lambda: dict(_REMEDIATIONS))


_FLEET_CATEGORIES: tuple[Category, ...] = ("interconnect",)


class FleetPolicy(BaseModel):
    """Faults that span jobs: several nodes under one shared component (a leaf switch, a rack)
    failing within a window become one fleet incident on the component (streams/fleet.py)."""

    model_config = ConfigDict(extra="forbid")

    # Slurm's topology.conf (topology/tree): each leaf switch is a domain ("switch:NAME").
    topology_file: Path | None = None
    # Domains by hand, name -> Slurm hostlist ({rack12: "gpu[01-16]"}): racks, PDUs, anything shared.
    domains: dict[str, str] = Field(default_factory=dict, max_length=10_000)
    categories: list[Category] = Field(default_factory=lambda: list(_FLEET_CATEGORIES), min_length=1)
    min_nodes: int = Field(default=2, ge=2)
    window_s: float = Field(default=600.0, gt=0, le=86400)
    # What a fleet incident does besides recommending the component for repair. recommend: nothing
    # more (each node's own incident decided its drain). drain: take every node of the domain out
    # of service as one drain set, under the guardrails as a whole (the blast radius and the drains
    # per window count the set; a set over either is refused entirely, never cut short).
    action: Literal["recommend", "drain"] = "recommend"

    @field_validator("domains")
    @classmethod
    def _hostlists(cls, value: dict[str, str]) -> dict[str, str]:
        for name, nodes in value.items():
            try:
                if not expand_hostlist(nodes):
                    raise ValueError(f"domain {name}: no nodes in {nodes!r}")
            except HostlistError as exc:
                raise ValueError(f"domain {name}: {exc}") from None
        return value


class AutoReturn(BaseModel):
    """The optional automatic path back (trainmedic/ops/auto_return.py): nodes trainmedic drained
    are judged exactly as `nodes resume` judges them, without an operator asking, and resumed on a
    pass. Off by default: a new site returns nodes by hand until it trusts the health check."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # How long a node stays drained before it is first judged, and between two judgements of it.
    after_s: float = Field(default=1800.0, ge=0, le=30 * 86400)
    retry_s: float = Field(default=3600.0, gt=0, le=30 * 86400)
    # How many nodes the automatic path may return per hour, cluster-wide.
    max_per_hour: int = Field(default=4, ge=1, le=10_000)
    # How often the drained nodes are looked at.
    interval_s: float = Field(default=60.0, gt=0, le=86400)


class ReturnToService(BaseModel):
    """When a node trainmedic drained may go back into service (`trainmedic nodes resume`)."""

    model_config = ConfigDict(extra="forbid")

    # The node's health check, run from the API's host before a resume, as an argv: "{node}" in any
    # item becomes the node's name. Over SSH, say: [ssh, -o, BatchMode=yes, "{node}", dcgmi, diag,
    # -r, "2"], or NHC. Exit status 0 passes. Not srun: Slurm refuses a drained node's steps.
    # None: a node drained for a fault of its own (every trainmedic drain but a job rule's) is not
    # resumed at all - it needs a passing check.
    health_check: list[str] | None = Field(default=None, min_length=1, max_length=64)
    timeout_s: float = Field(default=900.0, gt=0, le=86400)
    # A lemon: this many isolating faults blamed on the node within the window keep it drained,
    # labelled for repair, whatever its check says.
    lemon_faults: int = Field(default=2, ge=1)
    lemon_window_days: float = Field(default=7.0, gt=0)
    automatic: AutoReturn = Field(default_factory=AutoReturn)


class ProvenancePolicy(BaseModel):
    """What evidence of each provenance may trigger (docs/security.md "Provenance"). Evidence of any
    provenance may restart or stop the job it is about; isolating a node needs evidence about that
    node of a provenance in `node_evidence` - the node's kernel, its GPU telemetry, the scheduler,
    an authenticated service - in the incident. A job's own output (and NVRx, which runs in the
    job) never isolates a node on its own: the isolation stays a recommendation for a person."""

    model_config = ConfigDict(extra="forbid")

    node_evidence: list[Provenance] = Field(default_factory=lambda: list(NODE_EVIDENCE), min_length=1)
    # Partitions (shell globs) where a job's own evidence may isolate a node the scheduler gives the
    # job, uncorroborated. A RISK (docs/security.md): any job there can drain its own nodes by
    # printing one line, and spend the cluster's drains per window. For a partition whose jobs are
    # all trusted, where waiting for the scheduler to mark a node down costs more than a wrong drain.
    job_isolates_own_nodes: list[str] = Field(default_factory=list, max_length=256)

    @field_validator("node_evidence")
    @classmethod
    def _not_job(cls, value: list[Provenance]) -> list[Provenance]:
        if "job" in value:
            raise ValueError(
                "job evidence never isolates a node on its own: name the partitions in job_isolates_own_nodes instead"
            )
        return value

    def job_may_isolate(self, partition: str | None) -> bool:
        return any(fnmatch.fnmatchcase(partition or "", p) for p in self.job_isolates_own_nodes)


DEFAULT_PROVENANCE = ProvenancePolicy()


class JobRule(BaseModel):
    """An operator's per-job setting by job name, user, account or partition: the values a job's
    owner writes after trainmedic= in its comment (streams/job_settings.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    match: JobMatch
    set: str = Field(min_length=1, max_length=256)

    @field_validator("set")
    @classmethod
    def _readable(cls, value: str) -> str:
        try:
            parse_value(value, "set")
        except JobSettingError as exc:
            raise ValueError(str(exc)) from None
        return value


class JobSettingsPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Read trainmedic=off|monitor|restarts=N from the job's Slurm Comment (sbatch --comment).
    from_comment: bool = True
    rules: list[JobRule] = Field(default_factory=list, max_length=256)


class PredictionPolicy(BaseModel):
    """What a pre-failure verdict about a GPU of a running job's node does (streams/migration.py,
    docs/prediction.md). Off by default: the catalog's thresholds and confidences are placeholders
    until readiness has scored them (issue 44, deliverable 3)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # How long a migration waits for the job's next completed checkpoint after draining the node;
    # past it the migration falls back: the node stays drained, the job runs on, and a failure is
    # handled as any other (the reactive path).
    checkpoint_wait_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    # A job that never reported a completed checkpoint (no parser for its saves, or none yet):
    # drain (the node only, the job runs on until it ends or fails), drain_and_requeue (move it
    # now, losing the steps since its start or last save), or none (recommend only).
    without_checkpoints: Literal["drain", "drain_and_requeue", "none"] = "drain"


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(default=1, ge=1, le=1)
    mode: Mode = "monitor"
    categories: dict[Category, Mode] = Field(default_factory=dict)
    partitions: dict[str, PartitionPolicy] = Field(default_factory=dict)
    # Rules are tried in order; the first that matches decides. Otherwise `actions`.
    rules: list[Rule] = Field(default_factory=list)
    actions: dict[Category, ActionKind]
    stop: Literal["cancel", "hold"] = "cancel"  # how `stop` from `actions` stops a job
    restart_budget: RestartBudget = Field(default_factory=RestartBudget)
    min_confidence: float = Field(default=0.6, ge=0.0, le=1.0)
    # Enforced by the executor (sinks/guardrails.py validates this section): cluster-wide caps
    # only. The per-job restart budget is `restart_budget`, the only one.
    guardrails: dict[str, Any] = Field(default_factory=dict)
    readiness: ReadinessSettings = Field(default_factory=ReadinessSettings)
    # What a job's owner (its comment) or an operator's job rule asks for one job: they govern
    # the actions on the job, never the drain of a node whose own fault endangers other jobs.
    job_settings: JobSettingsPolicy = Field(default_factory=JobSettingsPolicy)
    return_to_service: ReturnToService = Field(default_factory=ReturnToService)
    fleet: FleetPolicy = Field(default_factory=FleetPolicy)
    remediation: RemediationPolicy = Field(default_factory=RemediationPolicy)
    prediction: PredictionPolicy = Field(default_factory=PredictionPolicy)
    provenance: ProvenancePolicy = Field(default_factory=ProvenancePolicy)
    # Categories whose node-local fault isolates only a node the evidence names (issue 42, interconnect
    # by locality: NVLink/NVSwitch on the node, the node's own adapter or port). With no node named the
    # restart is a plain requeue and isolating is left to a person: unlike a failed GPU, whose rank
    # still points at one node, a port or link error with no host may be anywhere on the fabric.
    isolate_named_node_only: list[Category] = Field(default=["interconnect"], max_length=16)

    def mode_for(self, partition: str | None, category: Category | None = None) -> Mode:
        """Most specific wins: partition+category, partition, category, default."""
        part = self.partitions.get(partition or "")
        if part is not None and category is not None and category in part.categories:
            return part.categories[category]
        if part is not None and part.mode is not None:
            return part.mode
        if category is not None and category in self.categories:
            return self.categories[category]
        return self.mode

    def with_mode(self, mode: Mode) -> Policy:
        return self.model_copy(update={"mode": mode, "partitions": {}, "categories": {}})

    def with_overlay(self, overlay: ModeOverlay) -> Policy:
        """Apply operator mode changes (trainmedic mode set) on top of the file's modes."""
        partitions = {k: v.model_copy(deep=True) for k, v in self.partitions.items()}
        for name, part in overlay.partitions.items():
            base = partitions.setdefault(name, PartitionPolicy())
            if part.mode is not None:
                base.mode = part.mode
            base.categories.update(part.categories)
        return self.model_copy(
            update={
                "mode": overlay.mode or self.mode,
                "categories": {**self.categories, **overlay.categories},
                "partitions": partitions,
            }
        )


class ModeOverlay(BaseModel):
    """Mode changes made by operators at run time; stored apart from the policy file."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode | None = None
    categories: dict[Category, Mode] = Field(default_factory=dict)
    partitions: dict[str, PartitionPolicy] = Field(default_factory=dict)


def parse_policy(text: str, origin: str = "<policy>", limits: YamlLimits = FILE_LIMITS) -> Policy:
    """`limits`: FILE_LIMITS for files, API_LIMITS (no aliases) for request bodies."""
    try:
        # One bounded parse: alias bombs, deep nesting and oversize text are refused
        # before anything walks the data (schemas/yamlsafe.py).
        root = compose_yaml(text, origin, limits)
        data = construct_yaml(root, origin)
    except YamlError as exc:
        raise PolicyError(str(exc)) from None
    if not isinstance(data, dict):
        raise PolicyError(f"{origin}: line 1: expected a mapping with 'mode' and 'actions'")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        is_key = "[key]" in err["loc"]
        loc = tuple(p for p in err["loc"] if p != "[key]")
        field = ".".join(str(p) for p in loc) or "<root>"
        line = line_of(root, loc)
        msg = (
            f"unknown category (categories: {', '.join(CATEGORIES)})"
            if is_key and loc[:1] == ("actions",)
            else err["msg"]
        )
        raise PolicyError(f"{origin}: line {line}: field '{field}': {msg}") from None
    if "unknown" not in policy.actions:
        # Policies written before the category existed: "I don't know" never acts.
        policy.actions["unknown"] = "none"
    missing = [c for c in CATEGORIES if c not in policy.actions]
    if missing:
        raise PolicyError(
            f"{origin}: line {line_of(root, ('actions',))}: field 'actions': no action for {', '.join(missing)}"
        )
    _refuse_acting_on_unknown(policy, root, origin)
    return policy


def _refuse_acting_on_unknown(policy: Policy, root: yaml.Node | None, origin: str) -> None:
    """`unknown` means nobody knows the cause: no file may turn it into a scheduler action."""
    if policy.actions["unknown"] != "none":
        raise PolicyError(
            f"{origin}: line {line_of(root, ('actions', 'unknown'))}: field 'actions.unknown': must be none "
            f"(got {policy.actions['unknown']}): an unrecognised crash needs a person, never an automatic action"
        )
    for i, rule in enumerate(policy.rules):
        if rule.action != "none" and rule.match.category is not None and "unknown" in rule.match.category:
            raise PolicyError(
                f"{origin}: line {line_of(root, ('rules', i, 'match', 'category'))}: field "
                f"'rules.{i}.match.category': rule {rule.name!r} maps unknown to {rule.action}; only none is "
                "allowed: an unrecognised crash needs a person, never an automatic action"
            )


def load_policy(path: Path | str | None = None) -> Policy:
    p = Path(path) if path else DEFAULT_POLICY
    try:
        text = p.read_text()
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read policy file: {exc.strerror}") from None
    return parse_policy(text, str(p))


def load_overlay(path: Path) -> ModeOverlay:
    if not path.exists():
        return ModeOverlay()
    try:
        return ModeOverlay.model_validate(load_yaml(path.read_text(), str(path)) or {})
    except (YamlError, ValidationError) as exc:
        raise PolicyError(f"{path}: invalid mode overlay: {exc}") from None


def save_overlay(path: Path, overlay: ModeOverlay) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        "# Written by `trainmedic mode set`; overrides the modes of the policy file.\n"
        + yaml.safe_dump(overlay.model_dump(mode="json", exclude_defaults=True), sort_keys=True)
    )
    tmp.replace(path)  # atomic: the streams worker never reads a half-written file


def _culprit_words(incident: Incident) -> str:
    parts = []
    if incident.culprit_rank is not None:
        parts.append(f"rank {incident.culprit_rank}")
    if incident.culprit_gpu is not None:
        parts.append(f"GPU {incident.culprit_gpu}")
    return " ".join(parts) or "the failing process"


def node_reported_fault(incident: Incident, gate: ProvenancePolicy = DEFAULT_PROVENANCE) -> bool:
    """The culprit node's own kernel log, GPU telemetry or InfiniBand/RoCE port readings reported the
    fault (its producer runs there).

    Not ingested health events: the ingest endpoint takes the node from the request body under
    one shared token, and NVRx reports come from inside jobs - a job holding the token could
    otherwise name any node. Those drains need the scheduler's placement like a job's output.
    """
    node = incident.culprit_node
    own = {p for p in gate.node_evidence if p in ("kernel", "kernel_file", "gpu", "net")}
    return node is not None and any(
        e.node == node and e.role == "root" and e.provenance in own for e in incident.evidence
    )


#: The signature of the scheduler's evidence that it reported a node DOWN or NOT_RESPONDING
#: (streams/attribution.py adds it to an incident as corroboration).
SCHEDULER_NODE_DOWN = "slurm_node_down"


def node_failed_per_scheduler(incident: Incident, gate: ProvenancePolicy = DEFAULT_PROVENANCE) -> bool:
    """The incident's evidence is the scheduler reporting its culprit node DOWN or NOT_RESPONDING
    (and the policy takes the scheduler's word about a node): the executor may then drain a node
    Slurm failed itself, and needs no placement, as Slurm may have requeued the job off it."""
    node = incident.culprit_node
    return (
        node is not None
        and "scheduler" in gate.node_evidence
        and any(
            e.node == node and e.provenance == "scheduler" and e.signature == SCHEDULER_NODE_DOWN
            for e in incident.evidence
        )
    )


def node_evidence(incident: Incident, gate: ProvenancePolicy = DEFAULT_PROVENANCE) -> list[Evidence]:
    """The incident's evidence about its culprit node that may isolate it (a provenance of
    `gate.node_evidence`: the node's kernel or GPUs, the scheduler, a service), strongest first."""
    node = incident.culprit_node
    found = [e for e in incident.evidence if node is not None and e.node == node and e.provenance in gate.node_evidence]
    return sorted(found, key=lambda e: (-PROVENANCE_RANK[e.provenance], e.role != "root", e.time))


def strongest_provenance(evidence: list[Evidence]) -> Provenance | None:
    """The strongest provenance among the deciding (root) evidence, else among all of it."""
    pool = [e for e in evidence if e.role == "root"] or evidence
    return max((e.provenance for e in pool), key=lambda p: PROVENANCE_RANK[p], default=None)


def job_evidence_only(incident: Incident, gate: ProvenancePolicy = DEFAULT_PROVENANCE) -> bool:
    """The culprit is one of the job's nodes per the scheduler, and nothing but evidence the job
    could write calls for isolating it: the job may be restarted or stopped, the node is not drained."""
    return (
        incident.culprit_node is not None
        and bool(incident.culprit_in_job)
        and not node_evidence(incident, gate)
        and not gate.job_may_isolate(incident.partition)
    )


def isolation(incident: Incident, gate: ProvenancePolicy = DEFAULT_PROVENANCE) -> tuple[bool, str]:
    """Whether draining the incident's culprit node may be carried out, and why not.

    Verdict and permission are separate: attribution says the fault lives on the node; this says
    whether the evidence's provenance may take it out of service. A node is isolated on evidence
    about it from its own kernel or GPU telemetry, the scheduler or an authenticated service (the
    policy's `provenance.node_evidence`), or, where the policy relaxes it for the partition, on
    the job's own evidence about one of its nodes per the scheduler. A job's output alone - a
    node-failure line, an adapter error naming a host - never isolates a node: it restarts or
    stops only the job, and the isolation stays a recommendation for a person.
    """
    node = incident.culprit_node
    if node is None:
        return False, f"the culprit is {_culprit_words(incident)}, not resolved to a node of the job"
    if node_reported_fault(incident, gate):
        return True, f"{node} reported the fault itself"
    strong = node_evidence(incident, gate)
    if strong:
        e = strong[0]
        return True, f"{e.provenance} evidence about {node} ({e.signature})"
    if incident.culprit_in_job is False:
        nodes = ", ".join(incident.job_nodes) or "none known"
        return False, (
            f"culprit {node} is named by the job's output but is not one of the job's nodes per the scheduler "
            f"({nodes}): no isolating action"
        )
    if incident.culprit_in_job and gate.job_may_isolate(incident.partition):
        return True, (
            f"{node} is one of the job's nodes per the scheduler, and partition {incident.partition} lets "
            "the job's own evidence isolate it (provenance.job_isolates_own_nodes)"
        )
    if incident.culprit_in_job:
        return False, (
            f"only evidence the job could write names {node} (provenance job): it restarts or stops the job, "
            f"never isolates a node on its own; no {'/'.join(gate.node_evidence)} evidence about {node} "
            "corroborates it (for a node failure: Slurm reporting the node DOWN or NOT_RESPONDING; for an "
            "adapter or port error: the node's own port state or counters): isolating it is for a person to decide"
        )
    return False, f"culprit {node} is named by the job's output and the scheduler's placement of the job is unknown"


#: What is left of an isolating action when only the job's own evidence calls for it: its job part.
_JOB_ONLY: dict[ActionKind, ActionKind] = {"drain_and_requeue": "requeue", "drain_and_stop": "stop", "drain": "none"}

#: The actions that restart the job; which of the two a category's restart is, the fault says.
RESTARTS: tuple[ActionKind, ...] = ("requeue", "drain_and_requeue")


def choose_action(policy: Policy, incident: Incident) -> tuple[ActionKind, str]:
    """The action the incident's facts call for under the policy's category mapping (`actions`),
    and the rule that says so. The only place an incident's facts become an action kind.

    The category says whether the job is restarted, stopped or left alone. Whether a restart
    takes the culprit's node out first is not the category's but the fault's (`isolate`, from
    the deciding signal's catalog entry): NVIDIA's RESTART_APP Xids (a contained ECC error, say)
    need the job restarted, not the node taken out; an uncorrectable ECC error, a node failure or
    the node's own InfiniBand port going down take the node out, whatever the category maps to.
    Isolation is chosen whether or not the node is known: `decide` never downgrades it to a plain
    restart for want of one.
    """
    configured = policy.actions[incident.category]
    rule = f"actions.{incident.category}={configured}"
    if configured not in RESTARTS:
        return configured, rule
    if incident.isolate:
        return "drain_and_requeue", rule + (
            "" if configured == "drain_and_requeue" else " (fault of the node: isolate)"
        )
    return "requeue", rule + ("" if configured == "requeue" else " (not a fault of the node: requeue)")


def decide(
    policy: Policy,
    incident: Incident,
    now: float,
    recent_restarts: int = 0,
    history: RestartHistory | None = None,
) -> tuple[Decision, Action | None]:
    """Turn an incident into a decision, and an action when autonomy allows it.

    The action is `choose_action`'s, unless a rule matches first: a rule is an operator's
    explicit choice and is taken as written. On top: what may be carried out (isolation,
    no job), the restart budget, the mode and min_confidence.

    `recent_restarts`: restarts this policy already ordered for the job within the
    restart budget's window (the caller counts them). `history`: the job's attempt lineage
    (streams/lineage.py): restarts in a row without progress, and what ended the previous attempt.
    """
    if incident.domain is not None:
        return _fleet_decision(policy, incident, now)
    if incident.kind == "predicted":
        predicted, act, _ = decide_predicted(policy, incident, now, True, recent_restarts)
        return predicted, act
    matched = next((r for r in policy.rules if r.match.matches(incident)), None)
    action: ActionKind
    if matched is not None:
        action, stop_mode, rule = matched.action, matched.stop, f"rules.{matched.name}={matched.action}"
    else:
        action, rule = choose_action(policy, incident)
        stop_mode = policy.stop
    reasons = [f"{incident.category} with confidence {incident.confidence:.2f}"]
    # Set when the decision may only be a recommendation, whatever the mode says.
    hold: str | None = None
    if incident.category in NEVER_ACTS and action != "none":
        # A rule without a category filter matched: "healthy" and "unknown" still never act.
        rule += f" ({incident.category} never acts: none)"
        action = "none"
    isolatable, note = isolation(incident, policy.provenance)
    exclude_culprit = False
    if action in DRAINS and not isolatable:
        if incident.culprit_node is not None and incident.culprit_in_job is False:
            # A job's output named a node the scheduler did not give it: draining it would let one
            # job's text take another job's node out of service.
            action = "none"
            rule += " (culprit outside the job: none)"
            reasons.append(note)
        elif job_evidence_only(incident, policy.provenance):
            # The job's own evidence about one of its nodes: it may restart or stop the job that wrote
            # it, not take the node out of service. The isolation is a recommendation for a person.
            action = _JOB_ONLY[action]
            # The job may at least keep itself off the node its own output blamed: that touches no
            # one else, and a real fault would otherwise fail the restart on the same node.
            exclude_culprit = True
            rule += (
                f" (job evidence only: {action} of the job, without {incident.culprit_node} if restarted; "
                f"isolating {incident.culprit_node} is for a person)"
            )
            reasons.append(f"{note}; isolating {incident.culprit_node} recommended")
        elif incident.culprit_node is None and incident.category in policy.isolate_named_node_only:
            # A node-local fault (the catalog's locality) whose node the evidence does not name: the
            # job restarts, and a person finds the node (policy isolate_named_node_only).
            action = _JOB_ONLY[action]
            rule += (
                f" (node-local {incident.category} fault, no node named: {action}; finding the node is for a person)"
            )
            reasons.append(f"{note}: the node is for a person to find")
        else:
            # Never a silent plain restart: it may land on the same bad GPU. Recommend the
            # isolation, naming what is known, and leave it to a person.
            hold = note
            rule += " (culprit not resolved to a node of the job: recommendation only)"
            reasons.append(f"{note}: recommendation only")
    budget = policy.restart_budget
    job = job_settings(policy, incident)
    limit = budget.max_restarts
    if job.max_restarts is not None:
        if job.max_restarts <= budget.max_restarts:
            limit = job.max_restarts
        else:
            reasons.append(
                f"restarts={job.max_restarts} of {job.restarts_source()} capped by the policy's restart budget "
                f"({budget.max_restarts})"
            )
    # Ours within the window, or Slurm's own count of the job's restarts (whoever made them: an
    # operator's approval, a worker before a broker restart, Slurm itself): the higher.
    slurm_restarts = incident.job_restarts or 0
    used = max(recent_restarts, slurm_restarts)
    if action in RESTARTS and incident.job_id and used >= limit:
        # The job keeps failing: another restart would burn more GPU-hours. Stop it for a human.
        counted = (
            f"{recent_restarts} restarts in {budget.window_h:g} h"
            if recent_restarts >= slurm_restarts
            else f"Slurm restarted the job {slurm_restarts} times"
        )
        by = "" if limit == budget.max_restarts else f", limit {limit} set by {job.restarts_source()}"
        rule += f" (restart budget: {counted}{by}: stop and escalate)"
        action, stop_mode = _stop_keeping_the_drain(action, hold), budget.stop
    history = history or RestartHistory()
    if action in RESTARTS and incident.job_id and history.no_progress >= budget.no_progress_limit:
        # Restarts that buy no progress burn the allocation: NVRx's rule, counted across attempts.
        rule += (
            f" (no progress: {history.no_progress} restarts in a row without a higher step or a new checkpoint, "
            f"limit {budget.no_progress_limit}: stop and escalate)"
        )
        action, stop_mode = _stop_keeping_the_drain(action, hold), budget.stop
    same = _same_cause_elsewhere(history, incident)
    if action in DRAINS and incident.job_id and same is not None:
        # One cause following the job from node to node is the job's (or its configuration's), not the
        # nodes': draining another healthy node would not help. A person decides.
        rule += f" ({same}: the job or its configuration, not the nodes: stop recommended)"
        reasons.append(f"{same}: recommendation only")
        action, stop_mode = "stop", budget.stop
    else:
        same = None
    action, rule, job_hold = _apply_job_settings(job, incident, action, rule, reasons)
    if not incident.job_id and action in ("requeue", "stop"):
        action = "none"
        rule += " (no job known: nothing to restart or stop)"
    mode = policy.mode_for(incident.partition, incident.category)
    executed = (
        mode == "autonomous"
        and action != "none"
        and (hold is None or action not in DRAINS)
        and job_hold is None
        and same is None
    )
    if executed and incident.confidence < policy.min_confidence:
        executed = False
        reasons.append(f"below min_confidence {policy.min_confidence:.2f}: recommendation only")
    if mode == "monitor":
        reasons.append(f"mode monitor for partition {incident.partition or '(default)'}: recommendation only")
    decision_id = stable_id("dec", incident.incident_id)
    deciding = _deciding_xid(policy, incident) if action in DRAINS else None
    remedy = deciding[:2] if deciding is not None else None
    culprit_gpu = incident.culprit_gpu
    if deciding is not None:
        reasons.append(f"then {deciding[0]} the node ({deciding[1]})")
        if deciding[0] == "reset_gpu":
            # The GPU whose Xid called for the reset, not whichever the incident names first
            # (None: the node agent resets every GPU of the idle node).
            culprit_gpu = deciding[2].gpu
    decision = Decision(
        event_id=decision_id,
        event_time=now,
        decision_id=decision_id,
        incident_id=incident.incident_id,
        job_id=incident.job_id,
        partition=incident.partition,
        category=incident.category,
        culprit_node=incident.culprit_node,
        culprit_rank=incident.culprit_rank,
        culprit_gpu=culprit_gpu,
        action=action,
        mode=mode,
        executed=executed,
        stop_mode=stop_mode,
        remediation=remedy[0] if remedy else None,
        remediation_bucket=remedy[1] if remedy else None,
        rule=rule,
        reason="; ".join(reasons),
        first_signal_time=incident.first_signal_time,
        incident_time=incident.event_time,
    )
    if not executed:
        return decision, None
    return decision, make_action(
        decision,
        incident.incident_id,
        requested_by="policy",
        now=now,
        node_reported_fault=node_reported_fault(incident, policy.provenance),
        node_failed=node_failed_per_scheduler(incident, policy.provenance),
        exclude_node=exclude_culprit and action == "requeue",
    )


def _fleet_decision(policy: Policy, incident: Incident, now: float) -> tuple[Decision, Action | None]:
    """A fleet incident (streams/fleet.py) names a shared component: it is recommended for repair.
    With `fleet.action: drain` and autonomy, the component's other nodes are also taken out as one
    drain set: the executor's guardrails judge the set as a whole (blast radius, drains per window,
    autonomy_partitions of every node in it) and refuse it entirely rather than drain part of it.

    The nodes that failed keep their own incidents' drains (for their own faults: their way back
    needs a health check); the set takes only the others, whichever reaches the executor first. A
    fleet incident that does not name its failed nodes gets no set. The set spans jobs and may
    span partitions this worker cannot map its nodes to, so it acts only where the category is
    autonomous by default and in every partition the policy names."""
    decision_id = stable_id("dec", incident.incident_id)
    nodes = ", ".join(incident.domain_nodes) or "-"
    rule = f"fleet: {incident.domain}: repair the shared component"
    reasons = [incident.explanation, f"its nodes: {nodes}"]
    action: ActionKind = "none"
    executed = False
    monitored = [
        p or "(default)" for p in (None, *policy.partitions) if policy.mode_for(p, incident.category) != "autonomous"
    ]
    mode: Mode = "monitor" if monitored else "autonomous"
    failed = set(incident.domain_failed_nodes)
    drain_set = fleet_drain_set(incident.domain_nodes, incident.domain_failed_nodes)
    if policy.fleet.action != "drain":
        reasons.append("recommendation only")
    elif not failed:
        reasons.append("the fleet incident names no failed nodes: no drain set (recommendation only)")
    elif not drain_set:
        reasons.append("every node of it failed and is drained for its own fault: no drain set")
    else:
        action = "drain"
        rule += "; fleet.action=drain: its other nodes as one drain set"
        executed = mode == "autonomous"
        if monitored:
            reasons.append(
                f"{incident.category} is in monitor mode for {', '.join(monitored)}; a drain set may span "
                "partitions: recommendation only"
            )
        elif incident.confidence < policy.min_confidence:
            executed = False
            reasons.append(f"below min_confidence {policy.min_confidence:.2f}: recommendation only")
    decision = Decision(
        event_id=decision_id,
        event_time=now,
        decision_id=decision_id,
        incident_id=incident.incident_id,
        job_id=None,
        partition=incident.partition,
        category=incident.category,
        culprit_node=None,
        action=action,
        mode=mode,
        executed=executed,
        rule=rule,
        reason="; ".join(reasons),
        first_signal_time=incident.first_signal_time,
        incident_time=incident.event_time,
    )
    if not executed:
        return decision, None
    act = make_action(decision, incident.incident_id, requested_by="policy", now=now)
    return decision, with_drain_set(act, incident.domain or "", drain_set)


def decide_predicted(
    policy: Policy, incident: Incident, now: float, checkpoints_known: bool, recent_restarts: int = 0
) -> tuple[Decision, Action | None, bool]:
    """A predicted failure (a pre-failure verdict, streams/migration.py): the decision, the action
    when autonomy allows it, and whether a migration waits for the job's next checkpoint.

    The node is drained at once (Slurm lets the job run on; nothing new lands there); the job is
    requeued off it at its next completed checkpoint, which `streams.migration` watches for. A job
    not known to save checkpoints gets `prediction.without_checkpoints`. A job whose restart budget
    is spent is not moved: the node is drained, and a failure is handled as any other. The job's
    settings (its comment's trainmedic=, the policy's job rules) govern the job, not the node: with
    off or monitor the node is drained and the job is not moved."""
    decision_id = stable_id("dec", incident.incident_id)
    node = incident.culprit_node or "?"
    pred = policy.prediction
    reasons = [incident.explanation, f"confidence {incident.confidence:.2f}"]
    migrate = False
    action: ActionKind
    job = job_settings(policy, incident)
    limit = policy.restart_budget.max_restarts
    if job.max_restarts is not None:
        limit = min(limit, job.max_restarts)
    if job.mode is not None or job.errors:
        why = f"trainmedic={job.mode} by {job.mode_source()}" if job.mode else f"unreadable {job.errors[0]}"
        action = "drain"
        rule = f"prediction: drain {node} only ({why}: job {incident.job_id} is not moved)"
    elif not checkpoints_known:
        action = pred.without_checkpoints
        rule = f"prediction.without_checkpoints={action} (job {incident.job_id} never reported a completed checkpoint)"
    elif incident.job_id and recent_restarts >= limit:
        action = "drain"
        rule = (
            f"prediction: drain {node} only (restart budget spent: {recent_restarts} restarts in "
            f"{policy.restart_budget.window_h:g} h; the job is not moved)"
        )
    else:
        action, migrate = "drain", True
        rule = (
            f"prediction: drain {node} now, requeue job {incident.job_id} off it at its next completed checkpoint "
            f"(wait at most {pred.checkpoint_wait_s:g} s)"
        )
    mode = policy.mode_for(incident.partition, incident.category)
    executed = mode == "autonomous" and action != "none" and bool(incident.culprit_node)
    if executed and incident.confidence < policy.min_confidence:
        executed = False
        reasons.append(f"below min_confidence {policy.min_confidence:.2f}: recommendation only")
    if mode == "monitor":
        reasons.append(f"mode monitor for partition {incident.partition or '(default)'}: recommendation only")
    decision = Decision(
        event_id=decision_id,
        event_time=now,
        decision_id=decision_id,
        incident_id=incident.incident_id,
        job_id=incident.job_id,
        partition=incident.partition,
        category=incident.category,
        culprit_node=incident.culprit_node,
        culprit_gpu=incident.culprit_gpu,
        action=action,
        mode=mode,
        executed=executed,
        rule=rule,
        reason="; ".join(reasons),
        first_signal_time=incident.first_signal_time,
        incident_time=incident.event_time,
    )
    if not executed:
        return decision, None, False
    act = make_action(decision, incident.incident_id, requested_by="policy", now=now, node_reported_fault=True)
    return decision, act.model_copy(update={"predicted": True}), migrate


def fleet_drain_set(domain_nodes: list[str], failed_nodes: list[str]) -> list[str]:
    """A fleet incident's drain set: its domain's nodes but those whose own incidents made it."""
    failed = set(failed_nodes)
    return [n for n in domain_nodes if n not in failed]


def with_drain_set(action: Action, domain: str, nodes: list[str]) -> Action:
    """The fleet incident's drain action carrying its set. The repair label keeps the automatic
    return path off these nodes: the component needs a person first. The incident id stays first,
    so the drain is recognisably trainmedic's."""
    return action.model_copy(update={"nodes": nodes, "reason": f"{action.reason} | repair: {domain}"})


def remediation_for(policy: Policy, incident: Incident) -> tuple[Remediation, str] | None:
    """The remediation and resolution bucket of the incident's deciding Xid, when the policy
    enables remediation and maps that bucket; None otherwise (no Xid, or a bucket with none)."""
    deciding = _deciding_xid(policy, incident)
    return deciding[:2] if deciding is not None else None


def _deciding_xid(policy: Policy, incident: Incident) -> tuple[Remediation, str, Evidence] | None:
    """remediation_for's answer and the Xid evidence it comes from."""
    if not policy.remediation.enabled or incident.culprit_node is None:
        return None
    from streams.catalog import default_xids

    xids = default_xids()
    for e in incident.evidence:
        if e.role != "root" or e.node != incident.culprit_node or not e.signature.startswith("xid_"):
            continue
        entry = xids.get(int(e.signature[4:])) if e.signature[4:].isdigit() else None
        if entry is not None and (kind := policy.remediation.buckets.get(entry.bucket)) is not None:
            return kind, entry.bucket, e
    return None


def _stop_keeping_the_drain(action: ActionKind, hold: str | None) -> ActionKind:
    """The stop that replaces a restart: a drain the fault called for (and that may be carried
    out) stays - a job's budget is the job's, the node's fault endangers the next job on it."""
    return "drain_and_stop" if action == "drain_and_requeue" and hold is None else "stop"


def _same_cause_elsewhere(history: RestartHistory, incident: Incident) -> str | None:
    """The previous attempt ended for the same cause (category and root signature) on another
    node: said in words, else None."""
    prev = history.previous
    if prev is None or prev.node is None or incident.culprit_node is None or prev.node == incident.culprit_node:
        return None
    signature = root_signature(incident)
    if prev.category != incident.category or prev.signature != signature:
        return None
    return (
        f"same cause ({incident.category}, {signature or 'no signature'}) as the previous attempt "
        f"({prev.incident_id} on {prev.node}), now on {incident.culprit_node}"
    )


def job_settings(policy: Policy, incident: Incident) -> Effective:
    """The settings of the incident's job: its comment's (when the policy reads comments) and the
    policy's job rules that match it, merged strictest first (streams/job_settings.py)."""
    found: list[JobSetting] = []
    errors: list[str] = []
    if policy.job_settings.from_comment:
        try:
            found.extend(from_comment(incident.job_comment))
        except JobSettingError as exc:
            errors.append(str(exc))
    for r in policy.job_settings.rules:
        if r.match.matches(incident):
            found.append(parse_value(r.set, f"job_settings.rules.{r.name}"))
    return merge(found, errors)


def _apply_job_settings(
    job: Effective, incident: Incident, action: ActionKind, rule: str, reasons: list[str]
) -> tuple[ActionKind, str, str | None]:
    """What the job's settings leave of `action`, the rule text, and why what is left may only be
    recommended (None: the mode decides). They govern the job, not the node: a node whose own
    fault calls for its isolation is still drained (`drain`: the node only), since it would
    fail the next jobs placed on it."""
    if action == "none" or (job.mode is None and not job.errors):
        return action, rule, None
    if job.mode == "off":
        why = f"trainmedic=off by {job.mode_source()}"
        if action in DRAINS and incident.isolate:
            if action != "drain":
                reasons.append(f"{why}: job {incident.job_id} is not {'stopped' if action in STOPS else 'requeued'}")
            return "drain", rule + f" ({why}: the node only, the job is not touched)", None
        return "none", rule + f" ({why}: the job is not touched)", None
    why = f"trainmedic=monitor by {job.mode_source()}" if job.mode == "monitor" else f"unreadable {job.errors[0]}"
    if action in DRAINS and incident.isolate:
        if action != "drain":
            what = "stop" if action in STOPS else "requeue"
            reasons.append(f"{why}: {what} of job {incident.job_id} recommended, not done")
            rule += f" ({why}: the node only, the job's {what} is recommended)"
        return "drain", rule, None
    reasons.append(f"{why}: recommendation only")
    return action, rule + f" ({why}: recommendation only)", why


def make_action(
    decision: Decision,
    incident_id: str,
    requested_by: str,
    now: float,
    node_reported_fault: bool = False,
    node_failed: bool = False,
    exclude_node: bool = False,
) -> Action:
    # Stable per incident and step, so a redelivered or re-approved action is recognised.
    action_id = stable_id("act", incident_id, decision.action)
    return Action(
        event_id=action_id,
        event_time=now,
        action_id=action_id,
        decision_id=decision.decision_id,
        incident_id=incident_id,
        job_id=decision.job_id,
        node=decision.culprit_node,
        partition=decision.partition,
        action=decision.action,
        stop_mode=decision.stop_mode,
        remediation=decision.remediation,
        remediation_bucket=decision.remediation_bucket,
        culprit_gpu=decision.culprit_gpu,
        reason=f"trainmedic {incident_id}: {decision.category}",
        requested_by=requested_by,
        incident_time=decision.incident_time,
        first_signal_time=decision.first_signal_time,
        # The node's own kernel/GPU/health evidence: the executor need not find it in the job's
        # allocation. Operator approvals leave it False, so the executor checks (fails closed).
        node_reported_fault=node_reported_fault,
        node_failed=node_failed,
        exclude_node=exclude_node,
    )


def explain(policy: Policy, incident: Incident) -> list[str]:
    """How `decide` reaches its answer for this incident, step by step (dry run)."""
    lines = [
        f"incident {incident.incident_id}: {incident.category} (severity {incident.severity}, confidence "
        f"{incident.confidence:.2f}) partition {incident.partition or '-'} culprit {incident.culprit_node or '-'} "
        f"fault of the node: {'yes' if incident.isolate else 'no'}",
        f"  job {incident.job_id or '-'} name {incident.job_name or '-'} user {incident.user or '-'} "
        f"account {incident.account or '-'}",
    ]
    for r in policy.rules:
        lines.append(f"  rule {r.name}: {'MATCHES' if r.match.matches(incident) else 'no match'} -> {r.action}")
    chosen, by = choose_action(policy, incident)
    lines.append(f"  facts call for: {chosen} ({by})")
    isolatable, note = isolation(incident, policy.provenance)
    lines.append(f"  isolation: {'allowed' if isolatable else 'not allowed'} ({note})")
    lines.append(f"  job settings: {job_settings(policy, incident).describe()}")
    decision, action = decide(policy, incident, now=incident.event_time)
    lines.append(f"  decision: {decision.action} by {decision.rule}")
    lines.append(f"  mode: {decision.mode} ({decision.reason})")
    lines.append(
        f"  result: {'action ' + action.action_id if action else 'recommendation only'} (dry run: nothing sent)"
    )
    return lines
