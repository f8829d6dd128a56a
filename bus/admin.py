"""Topic setup: every trainmedic topic with its partition count and retention.

Partition counts are fixed once topics exist: keys are hashed onto partitions, so growing a
topic would move a job's events onto another partition and split its state. An existing topic
with another count is reported, never changed. Retention must cover what workers read back at
start (the guardrails' attempts, scheduler history for allocations: 24 h); the operators' mode
changes are kept for ever (a worker rebuilds the modes from the whole topic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from bus.config import admin_config
from schemas.errors import ConfigError, Unavailable
from schemas.topics import ALL_TOPICS, DEFAULT_PARTITIONS

HOUR_MS = 3600 * 1000


class TopicsUnavailable(Unavailable, RuntimeError):
    pass


class TopicMismatch(ConfigError, ValueError):
    """A topic exists with another partition count than trainmedic's."""


@dataclass
class TopicsReport:
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    mismatched: dict[str, int] = field(default_factory=dict)  # name -> its partition count


def check_bootstrap(bootstrap: str, timeout: float = 10.0) -> None:
    """Kafka answers at `bootstrap`: a malformed address is a ConfigError (exit 2), silence is
    Unavailable (exit 3: restarting once Kafka is back may help)."""
    for part in bootstrap.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--bootstrap / TRAINMEDIC_BOOTSTRAP {bootstrap!r}: expected HOST:PORT[,HOST:PORT]")
    try:
        AdminClient(admin_config(bootstrap)).list_topics(timeout=timeout)
    except Exception as exc:  # confluent_kafka raises KafkaException with a cause
        raise TopicsUnavailable(
            f"--bootstrap / TRAINMEDIC_BOOTSTRAP {bootstrap}: Kafka does not answer within {timeout:.0f} s ({exc})"
        ) from None


def topic_configs(retention_hours: float | None) -> dict[str, dict[str, str]]:
    if retention_hours is None:
        return {}
    kept = str(int(retention_hours * HOUR_MS))
    return {t.name: {"retention.ms": "-1" if t.kept_forever else kept} for t in ALL_TOPICS}


def ensure_topics(
    bootstrap: str,
    partitions: int = DEFAULT_PARTITIONS,
    timeout: float = 20.0,
    retention_hours: float | None = None,
) -> TopicsReport:
    """Create every trainmedic topic that does not exist yet (retention: the broker's default
    when None); report the existing ones and those whose partition count differs."""
    admin = AdminClient(admin_config(bootstrap))
    try:
        meta = admin.list_topics(timeout=timeout).topics
    except Exception as exc:  # confluent_kafka raises KafkaException with a cause
        raise TopicsUnavailable(f"cannot reach Kafka at {bootstrap}: {exc}") from None
    report = TopicsReport()
    configs = topic_configs(retention_hours)
    wanted = []
    for t in ALL_TOPICS:
        if t.name in meta:
            report.existing.append(t.name)
            count = len(meta[t.name].partitions)
            if count != partitions:
                report.mismatched[t.name] = count
        else:
            wanted.append(
                NewTopic(t.name, num_partitions=partitions, replication_factor=-1, config=configs.get(t.name, {}))
            )
    if wanted:
        for name, fut in admin.create_topics(wanted, operation_timeout=timeout).items():
            try:
                fut.result(timeout)
                report.created.append(name)
            except Exception as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise TopicsUnavailable(f"cannot create topic {name} on {bootstrap}: {exc}") from None
                report.existing.append(name)
    return report


def end_offsets(bootstrap: str, timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """(topic, partition) -> its end offset, for every topic on the broker (internal ones too).
    On the embedded broker an end offset is the first offset of the partition's last batch + 1
    (docs/environment.md): it is used to size what the broker holds, never to position a consumer."""
    admin = AdminClient(admin_config(bootstrap))
    try:
        meta = admin.list_topics(timeout=timeout).topics
        wanted = {TopicPartition(name, p): OffsetSpec.latest() for name, tm in meta.items() for p in tm.partitions}
        if not wanted:
            return {}
        futures = admin.list_offsets(wanted, request_timeout=timeout)
        return {(tp.topic, tp.partition): int(f.result(timeout).offset) for tp, f in futures.items()}
    except Exception as exc:  # confluent_kafka raises KafkaException with a cause
        raise TopicsUnavailable(f"cannot read the end offsets at {bootstrap}: {exc}") from None
