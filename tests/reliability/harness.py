"""Helpers shared by the reliability tests and bench/reliability.py: events made in
bulk, exact end offsets from delivery reports, committed offsets of a group, the
audit sink as a child process, and counting the audit of a chDB folder from another
process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from bus.config import consumer_config, producer_config
from schemas.codec import encode
from schemas.events import Anomaly, Event, Evidence, Incident
from schemas.topics import DEFAULT_PARTITIONS, partition_key
from trainmedic.stack.supervisor import die_with_parent

REPO = Path(__file__).resolve().parents[2]


class HarnessError(AssertionError):
    pass


def wait_until(what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2) -> Any:
    """Poll until probe returns something truthy; raise HarnessError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# --- events ------------------------------------------------------------------------------


def anomaly(
    i: int,
    job_id: str | None,
    node: str | None,
    *,
    job_nodes: Sequence[str] = (),
    signature: str = "xid_79",
    t: float | None = None,
    prefix: str = "storm",
) -> Anomaly:
    """A root-cause, isolating hardware anomaly (as the Xid detector makes for Xid 79)."""
    return Anomaly(
        event_id=f"anm-{prefix}-{i}",
        event_time=time.time() if t is None else t,
        detector="xid",
        signature=signature,
        category="gpu_hardware",
        severity="critical",
        role="root",
        isolate=True,
        source="kernel",
        job_id=job_id,
        node=node,
        partition="gpu",
        job_nodes=list(job_nodes),
        line=f"NVRM: Xid (PCI:0000:{i % 256:02x}:00): 79, pid=1, GPU has fallen off the bus. #{i}",
        meaning="GPU has fallen off the bus",
    )


def incident(i: int, prefix: str = "rel") -> Incident:
    now = time.time()
    return Incident(
        event_id=f"inc-{prefix}-{i}",
        incident_id=f"inc-{prefix}-{i}",
        event_time=now,
        job_id=str(5000 + i),
        partition="gpu",
        job_nodes=["gpu01", "gpu02"],
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        culprit_rank=3,
        confidence=0.9,
        isolate=True,
        explanation="xid_79 on gpu02",
        evidence=[
            Evidence(source="kernel", signature="xid_79", node="gpu02", rank=None, time=now, line="x", role="root")
        ],
        anomaly_ids=[f"anm-{prefix}-{i}"],
        first_signal_time=now - 1,
    )


@dataclass
class Produced:
    """Exact end offsets (last delivered offset + 1) per (topic, partition), from delivery reports."""

    end: dict[tuple[str, int], int] = field(default_factory=dict)
    delivered: int = 0
    failed: int = 0


def produce(bootstrap: str, pairs: Iterable[tuple[str, Event]], timeout: float = 30.0) -> Produced:
    """Publish events with the project's producer settings; offsets come from the delivery reports
    (the embedded broker answers "latest offset" wrongly, see docs/environment.md)."""
    out = Produced()
    producer = Producer(producer_config(bootstrap, "reliability-test"))

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            out.failed += 1
            return
        out.delivered += 1
        key = (msg.topic() or "", msg.partition() or 0)
        out.end[key] = max(out.end.get(key, 0), (msg.offset() or 0) + 1)

    for topic, event in pairs:
        while True:
            try:
                producer.produce(topic, value=encode(event), key=partition_key(event), on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.5)
        producer.poll(0)
    if producer.flush(timeout) != 0 or out.failed:
        raise HarnessError(f"could not deliver every event ({out.failed} failed)")
    return out


def committed(bootstrap: str, group: str, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    """The group's committed offsets (negative: nothing committed), read without joining the group."""
    consumer = Consumer(consumer_config(bootstrap, group, "reliability-offsets"))
    try:
        parts = [TopicPartition(t, p) for t in topics for p in range(DEFAULT_PARTITIONS)]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


def all_committed(bootstrap: str, group: str, produced: Produced) -> bool:
    offsets = committed(bootstrap, group, sorted({t for t, _ in produced.end}))
    return all(offsets.get(k, -1) >= end for k, end in produced.end.items())


def read_all(
    bootstrap: str,
    topic: str,
    want: int,
    timeout: float = 60.0,
    idle_s: float = 5.0,
    counts: Callable[[bytes], bool] | None = None,
) -> list[bytes]:
    """Every record of a topic by partition assignment, until `want` were read or nothing came for idle_s.
    With `counts`, only the records it accepts count toward `want` (the others are still returned)."""
    from confluent_kafka import OFFSET_BEGINNING

    consumer = Consumer(consumer_config(bootstrap, "reliability-reader", "reliability-reader"))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(DEFAULT_PARTITIONS)])
    out: list[bytes] = []
    counted = 0
    deadline = time.monotonic() + timeout
    last = time.monotonic()
    try:
        while time.monotonic() < deadline and counted < want and time.monotonic() - last < idle_s:
            for msg in consumer.consume(num_messages=10_000, timeout=0.5):
                if msg.error() is None:
                    value = msg.value() or b""
                    out.append(value)
                    counted += counts is None or counts(value)
                    last = time.monotonic()
    finally:
        consumer.close()
    return out


# --- the audit sink as a child process ---------------------------------------------------


class SinkProcess:
    """`python -m tests.reliability.sink_runner run ...` with its output in a file."""

    #: Every sink started; tests/reliability/conftest.py kills those a failed test left running.
    started: ClassVar[list[SinkProcess]] = []

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self._fh = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.sink_runner", "run", *args],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            preexec_fn=die_with_parent(),  # nor does one outlive the test session
        )
        SinkProcess.started.append(self)

    @classmethod
    def kill_leftovers(cls) -> None:
        for sink in cls.started:
            if sink.proc.poll() is None:
                sink.kill()
        cls.started.clear()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0, count: int = 1) -> list[str]:
        rx = re.compile(pattern, re.M)

        def found() -> list[str]:
            if self.proc.poll() is not None:
                raise HarnessError(f"the sink process exited ({self.proc.returncode}); its log:\n{self.text()[-3000:]}")
            hits = rx.findall(self.text())
            return hits if len(hits) >= count else []

        result: list[str] = wait_until(f"{pattern!r} x{count} in {self.log}", found, timeout)
        return result

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._fh.close()

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._fh.close()
        return rc

    def inserted(self, table: str) -> int:
        return sum(int(n) for n in re.findall(rf"^INSERTED {table} (\d+)$", self.text(), re.M))


def audit_counts(folder: Path, database: str, optimize: bool = True) -> dict[str, dict[str, int]]:
    """Row counts of every audit table in a chDB folder, read by a child process (one folder per process)."""
    args = [sys.executable, "-m", "tests.reliability.sink_runner", "count", "--chdb", str(folder)]
    args += ["--database", database] + (["--optimize"] if optimize else [])
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    if proc.returncode != 0:
        raise HarnessError(f"counting the audit failed: {proc.stderr[-3000:]}")
    counts: dict[str, dict[str, int]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return counts


# --- figures for bench/reliability.py ------------------------------------------------------

ROWS_ENV = "TRAINMEDIC_RELIABILITY_ROWS"


def report_row(
    fault: str,
    *,
    sent: int,
    landed: int,
    duplicates: int,
    actions_expected: int,
    actions_taken: int,
    where: str = "audit",
    note: str = "",
) -> None:
    """A reliability test's figures, written (after its assertions held) when bench/reliability.py
    runs the tests; a plain test run writes nothing. `landed`: events found afterwards in `where`;
    `duplicates`: events found more than once there; actions: scheduler changes (drains,
    requeues, cancels) expected and made."""
    path = os.environ.get(ROWS_ENV)
    if not path:
        return
    row = {
        "fault": fault,
        "sent": sent,
        "landed": landed,
        "where": where,
        "duplicates": duplicates,
        "actions_expected": actions_expected,
        "actions_taken": actions_taken,
        "note": note,
    }
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
