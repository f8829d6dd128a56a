"""What the embedded broker holds and what it costs, watched while `trainmedic up` runs.

Tansu 0.6's memory storage keeps every record it was sent: topic retention is not applied and
DeleteRecords is not implemented. Each fetch of a partition with new data lists every batch the
partition holds, so the broker's CPU per fetch and its memory grow for as long as `up` runs
(bench/results/broker-history.md). Nothing trainmedic can do from outside bounds it short of
restarting the broker, which loses what no consumer has read. So it is measured and said before
it becomes detection latency: gauges on /metrics, and a warning in the log and in `up`'s health
when one partition holds `embedded_broker_warn_records` or the broker keeps a core half busy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge

from bus.admin import end_offsets

log = logging.getLogger("trainmedic.stack.broker_watch")

STORED_RECORDS = Gauge("trainmedic_embedded_broker_records", "Records the embedded broker holds (it deletes none)")
LARGEST_PARTITION = Gauge(
    "trainmedic_embedded_broker_largest_partition_records",
    "Records in the embedded broker's fullest partition: each fetch of it lists them all",
)
RESIDENT_BYTES = Gauge("trainmedic_embedded_broker_resident_bytes", "The embedded broker's resident memory")
CPU_SECONDS = Counter("trainmedic_embedded_broker_cpu_seconds", "CPU time the embedded broker used")

# Half a core: the soak of bench/broker_history.py went from a fifth of a core to a whole one as the
# history grew, at a constant load. Past half, a fetch waits on the broker more than on its data.
BUSY_CORE_FRACTION = 0.5
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Holding:
    total: int
    largest: tuple[str, int, int]  # topic, partition, records
    resident_bytes: int | None
    busy: float | None  # the broker's CPU over the last interval, in cores; None on the first check


def process_usage(pid: int) -> tuple[float, int] | None:
    """CPU seconds and resident bytes of a process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = next((int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    return (int(stat[11]) + int(stat[12])) / _CLK_TCK, rss


class BrokerWatch:
    def __init__(self, bootstrap: str, pid: Callable[[], int | None], warn_records: int) -> None:
        if warn_records < 1:
            raise ValueError(f"embedded_broker_warn_records must be >= 1, got {warn_records}")
        self.bootstrap = bootstrap
        self.pid = pid
        self.warn_records = warn_records
        self.warnings: list[str] = []
        self.stop_event = threading.Event()
        self._records_logged = 0  # the multiple of warn_records (a power of two) last logged; 0: below it
        self._busy_logged = False
        self._last: tuple[int, float, float] | None = None  # pid, its CPU seconds, when

    def check(self) -> Holding:
        offsets = end_offsets(self.bootstrap)
        (topic, partition), most = max(offsets.items(), key=lambda kv: kv[1], default=(("", -1), 0))
        pid, busy, rss = self.pid(), None, None
        usage = process_usage(pid) if pid else None
        if pid and usage is not None:
            cpu, rss = usage
            now = time.monotonic()
            if self._last is not None and self._last[0] == pid and now > self._last[2]:
                CPU_SECONDS.inc(max(0.0, cpu - self._last[1]))
                busy = max(0.0, cpu - self._last[1]) / (now - self._last[2])
            self._last = (pid, cpu, now)  # a restarted broker (another pid) starts a new interval
            RESIDENT_BYTES.set(rss)
        held = Holding(sum(offsets.values()), (topic, partition, most), rss, busy)
        STORED_RECORDS.set(held.total)
        LARGEST_PARTITION.set(most)
        self._judge(held)
        return held

    def _judge(self, held: Holding) -> None:
        topic, partition, most = held.largest
        memory = f", {held.resident_bytes / 2**20:,.0f} MiB resident" if held.resident_bytes is not None else ""
        holds = f"{most:,} records in {topic}[{partition}] ({held.total:,} in all{memory})"
        remedy = (
            "it keeps every record and each fetch of a partition lists all it holds, so it slows and grows for as "
            "long as `up` runs; for a cluster, run Kafka and start `up --bootstrap` (docs/environment.md)"
        )
        self.warnings = []
        level = 0
        if most >= self.warn_records:
            level = 1 << ((most // self.warn_records).bit_length() - 1)  # the power of two reached
            self.warnings.append(f"the embedded broker holds {holds}: {remedy}")
            if level > self._records_logged:
                log.warning("%s", self.warnings[-1])
        self._records_logged = max(level, self._records_logged) if level else 0
        busy = held.busy is not None and held.busy >= BUSY_CORE_FRACTION
        if busy:
            self.warnings.append(
                f"the embedded broker used {held.busy:.0%} of a core lately, holding {holds}: {remedy}"
            )
            if not self._busy_logged:
                log.warning("%s", self.warnings[-1])
        self._busy_logged = busy  # logged again when it comes back

    def run(self, interval_s: float) -> None:
        """Check every `interval_s` until stopped; an unreadable broker is logged and tried again
        (the supervisor restarts a dead broker; this watch only reports)."""
        while not self.stop_event.is_set():
            try:
                self.check()
            except Exception as exc:  # a broker restarting or busy: the next round tries again
                log.info("embedded broker holdings unread: %s", exc)
            self.stop_event.wait(interval_s)
