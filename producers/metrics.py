"""The producers' own metrics and liveness: one `ProducerHealth` per producer loop.

Each loop (NVML, dcgm, kernel, logs, Slurm, ingest) registers a `bus.health` loop named
`producer-<name>`, beats every time round (idle rounds too) and with the events it
published, is ready after its first good poll and not ready again once polls keep failing
(`FAIL_AFTER` in a row): the probe listener answers /healthz and /readyz from that, and the
counters below say what failed. What each producer published, dropped or dead-lettered is
counted by its publisher (bus/metrics.py, `producer` = the publisher's client id).

`families(producer)` is what that producer's process exports, the failure counters' known
series created at 0 (an alert's `increase()` needs a sample before the first failure).
"""

from __future__ import annotations

from prometheus_client import Counter as PromCounter
from prometheus_client.registry import Collector

from bus import health

POLL_FAILURES = PromCounter(
    "trainmedic_producer_poll_failures_total",
    "Polls that failed (NVML sample, squeue/sinfo, job discovery, Kafka check), by producer and reason",
    ["producer", "reason"],
)
SCRAPE_FAILURES = PromCounter(
    "trainmedic_producer_scrape_failures_total", "dcgm-exporter scrapes that failed", ["producer"]
)
LINES_READ = PromCounter(
    "trainmedic_producer_lines_read_total", "Log lines read (kernel log, training logs)", ["producer"]
)
INGEST_ACCEPTED = PromCounter(
    "trainmedic_producer_ingest_accepted_total", "Ingest events accepted and queued for Kafka", ["producer", "origin"]
)
INGEST_REJECTED = PromCounter(
    "trainmedic_producer_ingest_rejected_total", "Ingest requests refused", ["producer", "reason"]
)

#: The reasons each producer counts failed polls by (the `reason` of POLL_FAILURES at each call
#: site; tests/unit/test_metric_roles.py holds this against the code).
POLL_FAILURE_REASONS: dict[str, tuple[str, ...]] = {
    "gpu": ("sample",),
    "ib": ("sample",),
    "logs": ("list", "describe", "tailer"),
    "slurm": ("command", "parse", "diff", "flush", "state_save", "unexpected"),
    "ingest": ("kafka",),
}
#: Producers that scrape an exporter, and those that read lines.
SCRAPERS = ("dcgm",)
LINE_READERS = ("kernel", "logs")
#: Where ingested events come from.
INGEST_ORIGINS = ("nvsentinel", "nvrx")


def families(producer: str) -> tuple[Collector, ...]:
    """The producer metrics `producer`'s process exports, each known series at 0."""
    found: list[Collector] = []
    if producer in POLL_FAILURE_REASONS:
        for reason in POLL_FAILURE_REASONS[producer]:
            POLL_FAILURES.labels(producer, reason)
        found.append(POLL_FAILURES)
    if producer in SCRAPERS:
        SCRAPE_FAILURES.labels(producer)
        found.append(SCRAPE_FAILURES)
    if producer in LINE_READERS:
        LINES_READ.labels(producer)
        found.append(LINES_READ)
    if producer == "ingest":
        for origin in INGEST_ORIGINS:
            INGEST_ACCEPTED.labels(producer, origin)
        # Refusals are not alerted on and their reasons are many: series come with the first.
        found += [INGEST_ACCEPTED, INGEST_REJECTED]
    return tuple(found)


#: Consecutive failed polls after which a producer that was ready says it is not.
FAIL_AFTER = 3


def stale_after(interval_s: float, longest_round_s: float = 0.0) -> float:
    """How long without a beat means stuck: five intervals, at least a minute, and never less
    than one round may take when every call in it runs to its timeout."""
    return max(60.0, 5.0 * interval_s, longest_round_s + interval_s)


class ProducerHealth:
    """One producer loop as bus.health and the alerts see it."""

    def __init__(self, producer: str, interval_s: float, longest_round_s: float = 0.0) -> None:
        self.producer = producer
        self.loop = health.loop(f"producer-{producer}", stale_after(interval_s, longest_round_s))
        self.failing = 0
        self.ever_ok = False

    def ok(self, published: int = 0, why: str = "polling") -> None:
        """A round that did its work (even with nothing new to publish)."""
        self.failing = 0
        self.loop.beat(processed=published)
        if not self.loop.ready:
            self.loop.set_ready(True, why)
        self.ever_ok = True

    def idle(self) -> None:
        """A round with nothing to read that says nothing about the source either way."""
        self.loop.beat()

    def failed(self, why: str) -> None:
        self.failing += 1
        self.loop.beat()
        if not self.ever_ok or self.failing >= FAIL_AFTER:
            self.loop.set_ready(False, f"{why} ({self.failing} in a row)" if self.failing > 1 else why)

    def stop(self) -> None:
        self.loop.stop()
