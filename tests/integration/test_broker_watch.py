"""What the embedded broker holds and costs, read from the real broker `up` starts
(trainmedic/stack/broker_watch.py): it keeps every record, so `up` measures and says it before it
becomes detection latency."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client import REGISTRY

from bus.config import admin_config, producer_config
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.broker_watch import BUSY_CORE_FRACTION, BrokerWatch
from trainmedic.stack.runtime import Stack, StackConfig


def _send(bootstrap: str, topic: str, partition: int, n: int) -> None:
    producer = Producer(producer_config(bootstrap, "test-broker-watch") | {"linger.ms": 0})
    for _ in range(n):
        producer.produce(topic, b"{}", partition=partition)
        producer.flush(10)  # one batch each: the end offset counts them exactly


def _record_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    # Only the watch's own: a thread another test left behind may log to the root logger too. And
    # only its record warnings: between two checks a moment apart, the broker serving the produces
    # can be half a core busy (70 % in a CI run), which is the busy warning's test below.
    return [
        m
        for r in caplog.records
        if r.name == "trainmedic.stack.broker_watch" and (m := r.getMessage()).startswith("the embedded broker holds")
    ]


def test_the_watch_names_the_fullest_partition_and_warns_once_per_doubling(
    broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    admin = AdminClient(admin_config(broker.bootstrap))  # held: a collected client cancels its futures
    admin.create_topics([NewTopic("watched", 2, 1)])["watched"].result(15)
    _send(broker.bootstrap, "watched", 1, 25)
    watch = BrokerWatch(broker.bootstrap, lambda: broker.pid, warn_records=10)
    caplog.set_level(logging.WARNING, "trainmedic.stack.broker_watch")

    held = watch.check()
    assert held.largest == ("watched", 1, 25)
    assert held.total >= 25 and held.resident_bytes is not None and held.resident_bytes > 0
    assert held.busy is None  # no interval yet
    assert REGISTRY.get_sample_value("trainmedic_embedded_broker_largest_partition_records") == 25
    assert REGISTRY.get_sample_value("trainmedic_embedded_broker_resident_bytes") == held.resident_bytes
    [warning] = watch.warnings
    assert "25 records in watched[1]" in warning and "--bootstrap" in warning
    assert len(_record_warnings(caplog)) == 1

    watch.check()  # nothing new: no second line in the log, the health warning stays
    assert len(_record_warnings(caplog)) == 1 and len(watch.warnings) == 1
    _send(broker.bootstrap, "watched", 1, 16)  # 41: past 4 x 10
    assert watch.check().largest == ("watched", 1, 41)
    lines = _record_warnings(caplog)
    assert len(lines) == 2 and "41 records" in lines[-1]

    quiet = BrokerWatch(broker.bootstrap, lambda: broker.pid, warn_records=1000)
    quiet.check()
    assert quiet.warnings == []
    with pytest.raises(ValueError, match="embedded_broker_warn_records"):
        BrokerWatch(broker.bootstrap, lambda: broker.pid, warn_records=0)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat (fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_watch_reads_the_brokers_cpu_from_proc(broker: EmbeddedBroker) -> None:
    """Busy is read from the process's own CPU time: a process spinning a core is busy, an idle one
    is not (stand-ins for the broker's pid; the records are the real broker's). The spinner's share
    of a core depends on what else the machine runs (the suite runs in parallel), so the watch's
    figure is checked against the CPU time /proc gives over the same interval, and the test waits
    for the spinner to have used a second of CPU rather than for a fixed time."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy_watch = BrokerWatch(broker.bootstrap, lambda: spinner.pid, warn_records=10**9)
        idle_watch = BrokerWatch(broker.bootstrap, lambda: idle.pid, warn_records=10**9)
        busy_watch.check()
        idle_watch.check()
        cpu0, t0 = _cpu_seconds(spinner.pid), time.monotonic()
        before = REGISTRY.get_sample_value("trainmedic_embedded_broker_cpu_seconds_total") or 0.0
        wait_for("the spinner to use a second of CPU", lambda: _cpu_seconds(spinner.pid) - cpu0 >= 1.0, timeout=60)
        busy = busy_watch.check().busy
        share = (_cpu_seconds(spinner.pid) - cpu0) / (time.monotonic() - t0)
        assert busy is not None and abs(busy - share) <= 0.15 and busy >= 0.2, (busy, share)
        assert (REGISTRY.get_sample_value("trainmedic_embedded_broker_cpu_seconds_total") or 0.0) - before >= 1.0
        if busy >= BUSY_CORE_FRACTION:
            [warning] = busy_watch.warnings
            assert "of a core lately" in warning
        else:
            assert busy_watch.warnings == []
        idle_busy = idle_watch.check().busy
        assert idle_busy is not None and idle_busy < 0.1 and idle_watch.warnings == []
    finally:
        spinner.kill()
        idle.kill()
        spinner.wait()
        idle.wait()


def test_up_says_it_in_health_and_restarts_a_dead_watch(
    chdb_url: str, database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process Stack with its embedded broker, as `up` runs it."""
    monkeypatch.setenv("TRAINMEDIC_EMBEDDED_BROKER_WARN_RECORDS", "3")
    stack = Stack(
        StackConfig(
            data_dir=tmp_path / "var",
            clickhouse=chdb_url,
            database=database,
            supervise=True,
            restart_backoff_s=(1.0,),
            broker_watch_s=0.5,
        ),
        SimulatedScheduler([]),
    ).start()
    try:
        assert stack.broker is not None and stack.broker_watch is not None
        _send(stack.bootstrap, "gpu.samples", 0, 4)
        health = wait_for("the warning in health", lambda: (h := stack.health()).get("warnings") and h, timeout=30)
        assert health["ok"] is True, health  # a warning, not a fault
        assert any("embedded broker holds" in w for w in health["warnings"])
        assert health["components"]["broker-watch"]["state"] == "up"

        first = stack.broker_watch
        first.stop_event.set()  # its loop ends: the supervisor sees the thread gone
        wait_for(
            "the watch restarted",
            lambda: stack.broker_watch is not first and stack.health()["components"]["broker-watch"]["restarts"] == 1,
            timeout=30,
        )
        wait_for("the warning again", lambda: stack.health().get("warnings"), timeout=30)
    finally:
        stack.stop()
