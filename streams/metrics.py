"""Prometheus metrics of the streams worker (served when TRAINMEDIC_METRICS_PORT is set).

`families()` is what the worker's process exports, the dead-letter counter's known series
created at 0 (an alert's `increase()` needs a sample before the first letter)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from schemas.vocab import CATEGORIES, MODES, Category

if TYPE_CHECKING:
    from streams.policy import Policy

LATENCY_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)

EVENTS_IN = Counter("trainmedic_stream_events_total", "Records consumed by a streams agent", ["agent", "topic"])
PUBLISHED = Counter("trainmedic_stream_published_total", "Records published by the streams worker", ["topic"])
DEAD_LETTERS = Counter("trainmedic_dead_letters_total", "Records sent to the dead-letter topic", ["component"])
RECORD_AGE = Gauge(
    "trainmedic_consumer_record_age_seconds",
    "Age of the last record consumed (now - its Kafka timestamp): consumer lag in time, broker-independent",
    ["component", "topic"],
)
INCIDENTS = Counter("trainmedic_incidents_total", "Incidents published", ["category"])
DECISIONS = Counter("trainmedic_decisions_total", "Decisions made", ["action", "kind"])
DETECTION_LATENCY = Histogram(
    "trainmedic_detection_latency_seconds", "First fault signal -> incident published", buckets=LATENCY_BUCKETS
)
SIGNALS_BEHIND = Gauge(
    "trainmedic_signals_behind_seconds",
    "How far the hang and straggler checks judge behind the wall clock (the worker reading a backlog)",
)
PENDING_GROUPS = Gauge("trainmedic_attribution_pending_groups", "Anomaly groups waiting for their window to close")
FOREIGN = Counter(
    "trainmedic_stream_foreign_events_total",
    "Records of another cluster a streams agent skipped (each cluster's workers judge only its own)",
    ["agent", "cluster"],
)
MODES_IN_DOUBT = Gauge(
    "trainmedic_modes_in_doubt",
    "1 while this worker has neither the mode state file nor the whole of mode.changes: all in monitor mode",
)
MODE = Gauge(
    "trainmedic_mode",
    "1 for the mode a partition's decisions are made in (partition '*': the cluster default), 0 for the other: "
    "policy file and operator changes, monitor while the operators' modes are in doubt",
    ["partition", "mode"],
)
AUTONOMOUS_CATEGORIES = Gauge(
    "trainmedic_autonomous_categories",
    "How many fault categories a partition decides autonomously (category overrides included); 0: monitor only",
    ["partition"],
)
DEFAULT_PARTITION = "*"
#: The `component` of DEAD_LETTERS: "streams" (a record it made that fits no message) and each
#: agent's (streams/app.py `accept`; tests/unit/test_metric_roles.py holds this against the code).
DEAD_LETTER_COMPONENTS = (
    "streams",
    "streams.attribute",
    "streams.detect_external",
    "streams.detect_gpu",
    "streams.detect_kernel",
    "streams.detect_logs",
    "streams.detect_net",
    "streams.detect_signals",
    "streams.fleet",
    "streams.migrations",
    "streams.placements",
    "streams.policy",
    "streams.route",
)
_FAMILIES = (
    EVENTS_IN,
    PUBLISHED,
    DEAD_LETTERS,
    RECORD_AGE,
    INCIDENTS,
    DECISIONS,
    DETECTION_LATENCY,
    SIGNALS_BEHIND,
    PENDING_GROUPS,
    FOREIGN,
    MODES_IN_DOUBT,
    MODE,
    AUTONOMOUS_CATEGORIES,
)
_shown: set[str] = set()


def show_modes(policy: Policy) -> None:
    """Set the mode gauges from the policy decisions are made by (after the operators' overlay,
    or monitor everywhere in doubt). A partition once shown stays, with the mode it has now
    (the default's when the policy no longer names it): a partition falling back to monitor
    must show as monitor, not vanish."""
    _shown.update({DEFAULT_PARTITION, *policy.partitions})
    for name in sorted(_shown):
        partition = None if name == DEFAULT_PARTITION else name
        mode = policy.mode_for(partition)
        for m in MODES:
            MODE.labels(name, m).set(1 if m == mode else 0)
        autonomous = [c for c in CATEGORIES if policy.mode_for(partition, cast("Category", c)) == "autonomous"]
        AUTONOMOUS_CATEGORIES.labels(name).set(len(autonomous))


def families() -> tuple[Collector, ...]:
    """What the streams worker exports, each dead-letter component's series at 0."""
    for component in DEAD_LETTER_COMPONENTS:
        DEAD_LETTERS.labels(component)
    return _FAMILIES
