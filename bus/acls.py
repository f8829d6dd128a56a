"""One Kafka principal per component and what each may do: the ACL matrix, as data.

The matrix is what docs/security.md shows (`markdown_table`, a test holds the doc to it) and what
`trainmedic topics acls` prints as kafka-acls.sh commands or Strimzi KafkaUser specs. It lives in
bus/ (beside the clients that connect as these principals) and names topics only through
schemas/topics.py, so a renamed topic changes the ACLs with it. tests/unit/test_acls.py holds each
row against the topics the component's own modules hold and, for the streams worker, against the
topics its Faust agents subscribe to.

Kafka ACLs cannot look inside a record: a node producer allowed to write `gpu.samples` may write
a sample in another node's name. That is what the per-node signing key (bus/identity.py) is for;
the ACLs keep a node's credential away from every decision topic (`actions`, `approvals`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Literal

from schemas.errors import UsageError
from schemas.topics import (
    ACTION_ATTEMPTS,
    ACTION_RESULTS,
    ACTIONS,
    ALL_TOPICS,
    ANOMALIES,
    ANOMALIES_BY_JOB,
    APPROVALS,
    DEADLETTER,
    DECISIONS,
    GPU_SAMPLES,
    GPU_SAMPLES_BY_JOB,
    GUARDRAIL_TRIPS,
    HEALTH_EXTERNAL,
    INCIDENTS,
    INCIDENTS_BY_DOMAIN,
    INPUT_TOPICS,
    JOB_ATTEMPTS,
    JOB_LOGS,
    JOB_PROGRESS,
    MIGRATIONS,
    MODE_CHANGES,
    NET_PORTS,
    NODE_COMMAND_RESULTS,
    NODE_COMMANDS,
    NODE_KERNEL,
    NODE_RETURNS,
    SCHED_EVENTS,
    Topic,
)

Where = Literal["node", "central", "hook"]
Operation = Literal["Read", "Write", "Create", "DescribeConfigs"]
_OWNER_OPS: tuple[Operation, ...] = ("Read", "Write", "Create", "DescribeConfigs")

# Groups the shared read-back helpers (bus/consume.py: read_records, Follower, fetched_end_offsets)
# name uniquely per call. They assign partitions and never commit, but librdkafka still asks the
# group for offsets, which needs Describe on it; Read (which implies Describe) on the prefix covers it.
READ_BACK = ("trainmedic-recovery-", "trainmedic-ends-")
# The streams worker's group and the prefix of its Faust topics: the setting streams_id, whose
# default this is; the chart sets it to RELEASE-trainmedic-streams (`with_streams_id`).
STREAMS_ID = "trainmedic-streams"


@dataclass(frozen=True)
class Component:
    """One deployable and the least Kafka access it needs."""

    name: str  # the principal's {component}, the chart's credential key, the unit's name
    where: Where
    runs: str  # the command it runs
    reads: tuple[Topic, ...] = ()
    writes: tuple[Topic, ...] = ()
    # Consumer groups by prefix: a group is cluster-scoped (`NAME.CLUSTER`, schemas/ids.py) and
    # the node agent's and the followers' carry a node or a random suffix.
    groups: tuple[str, ...] = ()
    # Topics it creates and owns by prefix (the Faust worker's changelog and assignor topics).
    owns_prefix: str = ""
    creates_topics: bool = False  # `topics create`: every topic of schemas/topics.py
    kafka: bool = True  # False: no Kafka client at all (no principal)
    modules: tuple[str, ...] = field(default=(), compare=False)  # where its topics are named


COMPONENTS: tuple[Component, ...] = (
    Component(
        "gpu",
        "node",
        "trainmedic produce gpu (or dcgm)",
        writes=(GPU_SAMPLES, DEADLETTER),
        modules=("producers.gpu_nvml", "producers.gpu_dcgm"),
    ),
    Component(
        "kernel", "node", "trainmedic produce kernel", writes=(NODE_KERNEL, DEADLETTER), modules=("producers.kernel",)
    ),
    Component("ib", "node", "trainmedic produce ib", writes=(NET_PORTS, DEADLETTER), modules=("producers.ib_sysfs",)),
    Component(
        "logs",
        "node",
        "trainmedic produce logs",
        reads=(SCHED_EVENTS,),
        writes=(JOB_LOGS, JOB_PROGRESS, DEADLETTER),
        groups=("trainmedic-placements-",),
        modules=("producers.joblogs", "producers.placements"),
    ),
    Component(
        "node-agent",
        "node",
        "trainmedic run node-agent",
        reads=(NODE_COMMANDS, NODE_COMMAND_RESULTS),
        writes=(NODE_COMMAND_RESULTS, DEADLETTER),
        groups=("trainmedic-node-agent-", *READ_BACK),
        modules=("sinks.node_agent",),
    ),
    Component(
        "slurm-producer",
        "central",
        "trainmedic produce slurm",
        writes=(SCHED_EVENTS, DEADLETTER),
        modules=("producers.slurm",),
    ),
    Component(
        "ingest",
        "central",
        "trainmedic run ingest",
        writes=(HEALTH_EXTERNAL, DEADLETTER),
        modules=("producers.ingest",),
    ),
    Component(
        "streams",
        "central",
        "trainmedic run streams",
        reads=(
            *INPUT_TOPICS,
            ANOMALIES,
            ANOMALIES_BY_JOB,
            GPU_SAMPLES_BY_JOB,
            INCIDENTS,
            INCIDENTS_BY_DOMAIN,
            ACTIONS,
            MODE_CHANGES,
            MIGRATIONS,
        ),
        writes=(
            ANOMALIES,
            ANOMALIES_BY_JOB,
            GPU_SAMPLES_BY_JOB,
            INCIDENTS,
            INCIDENTS_BY_DOMAIN,
            DECISIONS,
            ACTIONS,
            JOB_ATTEMPTS,
            MIGRATIONS,
            DEADLETTER,
        ),
        groups=(STREAMS_ID, "trainmedic-modes-", *READ_BACK),
        owns_prefix=STREAMS_ID,
        modules=("streams.app", "streams.recovery", "streams.modes", "streams.gpu_batches", "streams.fleet"),
    ),
    Component(
        "executor",
        "central",
        "trainmedic run executor",
        reads=(ACTIONS, ACTION_ATTEMPTS),
        writes=(ACTION_ATTEMPTS, ACTION_RESULTS, GUARDRAIL_TRIPS, NODE_COMMANDS, DEADLETTER),
        groups=("trainmedic-executor", *READ_BACK),
        modules=("sinks.executor", "sinks.lease"),
    ),
    Component(
        "audit-sink",
        "central",
        "trainmedic run audit-sink",
        reads=(
            SCHED_EVENTS,
            HEALTH_EXTERNAL,
            ANOMALIES,
            INCIDENTS,
            DECISIONS,
            ACTIONS,
            ACTION_ATTEMPTS,
            ACTION_RESULTS,
            APPROVALS,
            MODE_CHANGES,
            NODE_RETURNS,
            GUARDRAIL_TRIPS,
            DEADLETTER,
            JOB_ATTEMPTS,
            NODE_COMMANDS,
            NODE_COMMAND_RESULTS,
            MIGRATIONS,
        ),
        groups=("trainmedic-audit",),
        modules=("sinks.audit", "sinks.audit_schema"),
    ),
    Component(
        "api",
        "central",
        "trainmedic run api",
        reads=(INCIDENTS, DECISIONS, ACTION_RESULTS, APPROVALS, GUARDRAIL_TRIPS, MODE_CHANGES, NODE_RETURNS),
        writes=(APPROVALS, ACTIONS, MODE_CHANGES, NODE_RETURNS, MIGRATIONS, DEADLETTER),
        groups=("trainmedic-console-", "trainmedic-modes-", *READ_BACK),
        modules=(
            "trainmedic.web.api",
            "trainmedic.web.console.live",
            "trainmedic.ops.return_to_service",
            "trainmedic.ops.migrations",
        ),
    ),
    Component(
        "notifier",
        "central",
        "trainmedic run notifier",
        reads=(INCIDENTS, DECISIONS, GUARDRAIL_TRIPS),
        writes=(DEADLETTER,),
        groups=("trainmedic-notifier",),
        modules=("sinks.notifier",),
    ),
    Component("topics", "hook", "trainmedic topics create", creates_topics=True, modules=("bus.admin",)),
    Component("migrate", "hook", "trainmedic audit db migrate", kafka=False),
)
BY_NAME = {c.name: c for c in COMPONENTS}
NODE_COMPONENTS = tuple(c.name for c in COMPONENTS if c.where == "node")

DEFAULT_PRINCIPAL = "User:trainmedic-{component}"


class AclError(UsageError):
    """A principal format or component the ACLs cannot be written for."""


def principal(fmt: str, component: str) -> str:
    if "{component}" not in fmt:
        raise AclError(f"principal format {fmt!r} has no {{component}}: every component would share one principal")
    if ":" not in fmt:
        raise AclError(f"principal format {fmt!r} has no type (User:... )")
    return fmt.replace("{component}", component)


@dataclass(frozen=True, order=True)
class Rule:
    """One allowed operation on one resource, as Kafka's ACL model names them."""

    resource: Literal["topic", "group"]
    pattern: Literal["literal", "prefixed"]
    name: str
    operation: Operation


def rules(component: Component) -> list[Rule]:
    """The least rules that let `component` do what the matrix says, in a stable order.

    Read and Write imply Describe in Kafka. Writers also get DescribeConfigs on what they write:
    the publisher learns each topic's message size limit (bus/publish.py). A consumer that
    subscribes commits offsets, which needs Read on its group.
    """
    out: set[Rule] = set()
    for t in component.reads:
        out.add(Rule("topic", "literal", t.name, "Read"))
    for t in component.writes:
        out.add(Rule("topic", "literal", t.name, "Write"))
        out.add(Rule("topic", "literal", t.name, "DescribeConfigs"))
    for g in component.groups:
        out.add(Rule("group", "prefixed", g, "Read"))
    if component.owns_prefix:
        for op in _OWNER_OPS:
            out.add(Rule("topic", "prefixed", component.owns_prefix, op))
    if component.creates_topics:
        for t in ALL_TOPICS:
            out.add(Rule("topic", "literal", t.name, "Create"))
            out.add(Rule("topic", "literal", t.name, "DescribeConfigs"))
    return sorted(out)


def with_streams_id(component: Component, streams_id: str) -> Component:
    """`component` for a streams worker whose streams_id (group and topic prefix) is `streams_id`."""
    if component.owns_prefix != STREAMS_ID:
        return component
    groups = tuple(streams_id if g == STREAMS_ID else g for g in component.groups)
    return replace(component, groups=groups, owns_prefix=streams_id)


def components(names: list[str] | None = None, streams_id: str = STREAMS_ID) -> list[Component]:
    """The named components (all with Kafka access when none named); an unknown name is refused."""
    unknown = [n for n in names or () if n not in BY_NAME]
    if unknown:
        raise AclError(f"unknown component(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[n] for n in names] if names else [c for c in COMPONENTS if c.kafka]
    return [with_streams_id(c, streams_id) for c in chosen]


def grouped(component: Component) -> list[tuple[tuple[str, str, str], list[str]]]:
    """The rules of `component` as (resource, pattern, name) -> operations, in a stable order."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for r in rules(component):
        out.setdefault((r.resource, r.pattern, r.name), []).append(r.operation)
    return list(out.items())


def kafka_acls_commands(
    fmt: str, names: list[str] | None = None, bootstrap: str = "$BOOTSTRAP", streams_id: str = STREAMS_ID
) -> list[str]:
    """kafka-acls.sh invocations adding the ACLs (one per resource), for a shell with $BOOTSTRAP and $ADMIN_CONFIG."""
    lines: list[str] = []
    for c in components(names, streams_id):
        who = principal(fmt, c.name)
        for (resource, pattern, name), ops in grouped(c):
            target = f"--{resource} '{name}'"
            operations = " ".join(f"--operation {op}" for op in ops)
            lines.append(
                f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config $ADMIN_CONFIG --add "
                f"--allow-principal '{who}' {operations} {target} --resource-pattern-type {pattern}"
            )
    return lines


def strimzi_users(
    fmt: str, names: list[str] | None = None, cluster: str = "kafka", streams_id: str = STREAMS_ID
) -> list[dict[str, object]]:
    """Strimzi KafkaUser objects (SCRAM-SHA-512, simple authorization), one per component.

    Strimzi names the principal after the KafkaUser (`User:NAME`), so the format's type prefix is dropped.
    """
    users: list[dict[str, object]] = []
    for c in components(names, streams_id):
        name = principal(fmt, c.name).split(":", 1)[1]
        acls = [
            {"resource": {"type": resource, "name": name, "patternType": pattern}, "operations": ops}
            for (resource, pattern, name), ops in grouped(c)
        ]
        users.append(
            {
                "apiVersion": "kafka.strimzi.io/v1beta2",
                "kind": "KafkaUser",
                "metadata": {"name": name, "labels": {"strimzi.io/cluster": cluster}},
                "spec": {
                    "authentication": {"type": "scram-sha-512"},
                    "authorization": {"type": "simple", "acls": acls},
                },
            }
        )
    return users


def _cell(topics: tuple[Topic, ...]) -> str:
    return ", ".join(f"`{t.name}`" for t in topics) if topics else "-"


def markdown_table() -> str:
    """The matrix as docs/security.md shows it (generated; tests/unit/test_acls.py compares)."""
    rows = [
        "| component | runs on | command | reads | writes | consumer groups (prefix) |",
        "|---|---|---|---|---|---|",
    ]
    for c in COMPONENTS:
        if not c.kafka:
            rows.append(f"| `{c.name}` | {c.where} | `{c.runs}` | no Kafka access | no Kafka access | - |")
            continue
        reads = _cell(c.reads)
        if c.owns_prefix:
            reads += f"; its own `{c.owns_prefix}*` topics"
        writes = "creates every topic" if c.creates_topics else _cell(c.writes)
        if c.owns_prefix:
            writes += f"; creates and writes `{c.owns_prefix}*`"
        groups = ", ".join(f"`{g}`" for g in c.groups) or "-"
        rows.append(f"| `{c.name}` | {c.where} | `{c.runs}` | {reads} | {writes} | {groups} |")
    return "\n".join(rows)


def as_json() -> str:
    return json.dumps(
        [
            {
                "component": c.name,
                "where": c.where,
                "runs": c.runs,
                "reads": [t.name for t in c.reads],
                "writes": [t.name for t in c.writes],
                "groups": list(c.groups),
                "owns_prefix": c.owns_prefix or None,
                "creates_topics": c.creates_topics,
                "kafka": c.kafka,
            }
            for c in COMPONENTS
        ],
        indent=2,
    )
