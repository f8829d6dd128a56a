"""Prometheus counters of every `bus.publish.Publisher`: what each Kafka producer sent and lost.

The Publisher keeps the same counts in plain Counters (its callers print them on stop); these
make them visible to Prometheus, labelled by the publisher's client id less its `trainmedic-`
(`producer`: gpu, dcgm, kernel, logs, slurm, ingest, api, executor, ...: the same names as the
producers' own metrics, producers/metrics.py) and the topic.
Alert on `dropped` (an event lost: the buffer was full or the broker away past
message.timeout.ms) and `dead_lettered` (an event that could not fit any record).
"""

from __future__ import annotations

from prometheus_client import Counter

_LABELS = ["producer", "topic"]

SENT = Counter("trainmedic_producer_events_sent_total", "Records handed to the Kafka client", _LABELS)
DELIVERED = Counter("trainmedic_producer_events_delivered_total", "Records the broker acknowledged", _LABELS)
DROPPED = Counter(
    "trainmedic_producer_events_dropped_total",
    "Records lost: local buffer full, delivery failed or expired, or not even the dead letter fitted",
    _LABELS,
)
DEAD_LETTERED = Counter(
    "trainmedic_producer_events_dead_lettered_total",
    "Events over the message size limit sent to the dead-letter topic instead",
    _LABELS,
)
SPLIT = Counter("trainmedic_producer_events_split_total", "Events over the size limit sent in several parts", _LABELS)
