"""Prometheus counters of every `bus.publish.Publisher`: what each Kafka producer sent and lost.

The Publisher keeps the same counts in plain Counters (its callers print them on stop); these
make them visible to Prometheus, labelled by the publisher's client id less its `trainmedic-`
(`producer`: gpu, dcgm, kernel, logs, slurm, ingest, api, executor, ...: the same names as the
producers' own metrics, producers/metrics.py) and the topic.
Alert on `dropped` (an event lost: the buffer was full or the broker away past
message.timeout.ms) and `dead_lettered` (an event that could not fit any record).

`expect_publisher` makes a publisher's series exist at 0 from its process's start: a labelled
series that first appears with its first increment has no earlier sample, so `increase()` over
the alert's window misses that first burst.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter as PromCounter

from schemas.topics import DEADLETTER

_LABELS = ["producer", "topic"]

SENT = PromCounter("trainmedic_producer_events_sent_total", "Records handed to the Kafka client", _LABELS)
DELIVERED = PromCounter("trainmedic_producer_events_delivered_total", "Records the broker acknowledged", _LABELS)
DROPPED = PromCounter(
    "trainmedic_producer_events_dropped_total",
    "Records lost: local buffer full, delivery failed or expired, or not even the dead letter fitted",
    _LABELS,
)
DEAD_LETTERED = PromCounter(
    "trainmedic_producer_events_dead_lettered_total",
    "Events over the message size limit sent to the dead-letter topic instead",
    _LABELS,
)
SPLIT = PromCounter(
    "trainmedic_producer_events_split_total", "Events over the size limit sent in several parts", _LABELS
)

#: What a process with a publisher exports (trainmedic/stack/metrics_server.py, by role).
FAMILIES = (SENT, DELIVERED, DROPPED, DEAD_LETTERED, SPLIT)


def expect_publisher(producer: str, topics: Iterable[str]) -> None:
    """The series of a publisher (`producer`: its client id less `trainmedic-`) for the topics it
    publishes to, at 0 until it counts. Its dead letters are records on `deadletter` too: they
    are sent, delivered or dropped there."""
    topics = tuple(topics)
    for topic in (*topics, DEADLETTER.name):
        for metric in (SENT, DELIVERED, DROPPED):
            metric.labels(producer, topic)
    for topic in topics:
        for metric in (DEAD_LETTERED, SPLIT):
            metric.labels(producer, topic)


class MirroredCounter(Counter[str]):
    """A plain Counter whose increments also go to a Prometheus counter labelled (`owner`, key):
    the code that counts keeps writing `counts[key] += n`. Each key's labelled child is looked
    up once: the publisher counts on every event."""

    def __init__(self, metric: PromCounter, owner: str, *args: Any) -> None:
        super().__init__(*args)
        self._metric, self._owner = metric, owner
        self._children: dict[str, Any] = {}

    def __setitem__(self, key: str, value: int) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if delta > 0:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._metric.labels(self._owner, key)
            child.inc(delta)
