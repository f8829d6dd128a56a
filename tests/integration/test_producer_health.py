"""Producers' probes and counters against the real broker and real processes: `produce dcgm`
serves /readyz (ready once a scrape answered, not ready once scrapes keep failing) and its
publisher's counters on /metrics; the ingest is ready while Kafka answers; a Slurm producer
whose polls fail is alive but not ready; `produce gpu` on a host without NVML says so."""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from bus import health
from bus.publish import Publisher
from producers.ingest import run_ingest
from producers.slurm import LocalRunner, SlurmProducer
from schemas.events import KernelEvent
from schemas.topics import NODE_KERNEL
from tests.conftest import FIXTURES, wait_for
from tests.launch import probe, running, start, stop, wait_ready
from trainmedic.stack.broker import EmbeddedBroker, free_port

TRAINMEDIC = str(Path(sys.executable).with_name("trainmedic"))
PROM = (FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom").read_bytes()


class _Exporter(http.server.BaseHTTPRequestHandler):
    """A dcgm-exporter that answers the fixture, or 500 while `failing` is set."""

    failing = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.failing.is_set():
            self.send_error(500, "DCGM gone")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(PROM)))
        self.end_headers()
        self.wfile.write(PROM)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def exporter() -> Iterator[tuple[str, threading.Event]]:
    failing = threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("E", (_Exporter,), {"failing": failing}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", failing
    finally:
        server.shutdown()
        server.server_close()


def _metric(text: str, name: str, **labels: str) -> float | None:
    """One sample of a /metrics page (labels in any order)."""
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def test_produce_dcgm_is_ready_while_the_exporter_answers_and_not_while_it_fails(
    broker: EmbeddedBroker, exporter: tuple[str, threading.Event], tmp_path: Path
) -> None:
    url, failing = exporter
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [TRAINMEDIC, "produce", "dcgm", "--url", url, "--interval", "0.2", "--bootstrap", broker.bootstrap]
    env = {"PATH": str(Path(sys.executable).parent), "TRAINMEDIC_METRICS_PORT": str(port)}  # the setting, no flag
    with running(argv, env, tmp_path / "dcgm.log", f"{base}/readyz") as (proc, ready):
        loop = ready["loops"]["producer-dcgm"]  # type: ignore[index]
        assert loop["ready"] and "scraping" in loop["why"]
        page = wait_for(
            "delivered GPU samples on /metrics",
            lambda: (
                (p := _get(f"{base}/metrics"))
                and (_metric(p, "trainmedic_producer_events_delivered_total", producer="dcgm") or 0) > 0
                and p
            ),
        )
        assert _metric(page, "trainmedic_loop_ready", loop="producer-dcgm") == 1
        assert _metric(page, "trainmedic_build_info") == 1
        failing.set()
        status, body = wait_for(
            "not ready while scrapes fail", lambda: (r := probe(f"{base}/readyz"))[0] == 503 and r, timeout=60
        )
        assert body is not None and "scrape failed" in str(body["loops"]["producer-dcgm"]["why"])  # type: ignore[index]
        assert probe(f"{base}/healthz")[0] == 200  # failing, not stuck: alive
        page = _get(f"{base}/metrics")
        assert (_metric(page, "trainmedic_producer_scrape_failures_total", producer="dcgm") or 0) >= 3
        failing.clear()
        wait_for("ready again once the exporter answers", lambda: probe(f"{base}/readyz")[0] == 200, timeout=60)
        assert proc.proc.poll() is None


def test_publisher_counters_reach_prometheus(broker: EmbeddedBroker) -> None:
    def count(name: str, producer: str) -> float:
        return REGISTRY.get_sample_value(name, {"producer": producer, "topic": NODE_KERNEL.name}) or 0.0

    pub = Publisher(broker.bootstrap, "test-counted", config={"message.max.bytes": 20_000})
    for i in range(5):
        pub.publish(
            NODE_KERNEL,
            KernelEvent(event_id=f"k{i}", event_time=time.time(), node="n1", kind="xid", xid=79, text="Xid 79"),
        )
    pub.publish(
        NODE_KERNEL, KernelEvent(event_id="big", event_time=time.time(), node="n1", kind="xid", text="x" * 60_000)
    )
    assert pub.flush(30) == 0
    assert count("trainmedic_producer_events_sent_total", "test-counted") == pub.sent[NODE_KERNEL.name] == 5
    assert count("trainmedic_producer_events_delivered_total", "test-counted") == pub.delivered[NODE_KERNEL.name] == 5
    assert count("trainmedic_producer_events_dead_lettered_total", "test-counted") == 1
    assert count("trainmedic_producer_events_dropped_total", "test-counted") == 0
    pub.close()


def _serve_ingest(pub: Publisher, stop: threading.Event) -> threading.Thread:
    t = threading.Thread(
        target=run_ingest, args=(pub, "127.0.0.1", 0, "t" * 32), kwargs={"stop_event": stop}, daemon=True
    )
    t.start()
    return t


def test_ingest_is_ready_while_kafka_answers(broker: EmbeddedBroker) -> None:
    health.forget_all()
    stop = threading.Event()
    t = _serve_ingest(Publisher(broker.bootstrap, "test-ingest"), stop)
    try:
        loop = wait_for(
            "the ingest loop ready", lambda: (lp := health.loops().get("producer-ingest")) and lp.ready and lp
        )
        assert "Kafka reachable" in loop.why
    finally:
        stop.set()
        t.join(30)
    assert "producer-ingest" not in health.loops()  # stopped on request: no longer counted


def test_ingest_without_kafka_is_not_ready_and_says_why() -> None:
    health.forget_all()
    stop = threading.Event()
    before = (
        REGISTRY.get_sample_value("trainmedic_producer_poll_failures_total", {"producer": "ingest", "reason": "kafka"})
        or 0.0
    )
    t = _serve_ingest(Publisher("127.0.0.1:1", "test-ingest-away", learn_limits=False), stop)
    try:
        got = wait_for(
            "the ingest's failed Kafka check",
            lambda: (
                (
                    REGISTRY.get_sample_value(
                        "trainmedic_producer_poll_failures_total", {"producer": "ingest", "reason": "kafka"}
                    )
                    or 0.0
                )
                > before
                and health.loops()["producer-ingest"]
            ),
            timeout=60,
        )
        assert not got.ready and "Kafka does not answer" in got.why
    finally:
        stop.set()
        t.join(30)


def test_a_slurm_producer_whose_polls_fail_is_alive_but_not_ready(broker: EmbeddedBroker, tmp_path: Path) -> None:
    health.forget_all()
    runner = LocalRunner()
    runner.env = {**runner.env, "PATH": str(tmp_path)}  # no squeue there
    producer = SlurmProducer(
        Publisher(broker.bootstrap, "test-slurm"), state_path=tmp_path / "s.json", runner=runner, interval_s=0.1
    )
    stop = threading.Event()
    t = threading.Thread(target=producer.run, args=(stop,), daemon=True)
    t.start()
    try:
        loop = wait_for(
            "failed polls",
            lambda: (lp := health.loops().get("producer-slurm")) and lp.processed == 0 and lp.last_beat and lp,
        )
        wait_for("three failed polls", lambda: sum(producer.failed_polls.values()) >= 3)
        assert loop.alive and not loop.ready and "slurm poll failed" in loop.why
        assert (
            REGISTRY.get_sample_value(
                "trainmedic_producer_poll_failures_total", {"producer": "slurm", "reason": "command"}
            )
            or 0
        ) >= 3
    finally:
        stop.set()
        t.join(30)


def test_produce_gpu_on_this_host_without_nvml_exits_naming_nvml() -> None:
    from producers.gpu_nvml import NvmlCollector, NvmlUnavailable

    try:
        NvmlCollector().close()
    except NvmlUnavailable:
        pass
    else:
        pytest.skip("this host has NVML: `produce gpu` would run")
    done = subprocess.run(
        [TRAINMEDIC, "produce", "gpu", "--bootstrap", "127.0.0.1:1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("error: NVML is not available on this host") and "Traceback" not in done.stderr


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable (root)")
def test_produce_kernel_kmsg_beats_while_the_kernel_is_quiet_and_stops_on_sigterm(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [
        TRAINMEDIC,
        "produce",
        "kernel",
        "--kmsg",
        "--lookback",
        "0",
        "--bootstrap",
        broker.bootstrap,
        "--state-dir",
        str(tmp_path / "state"),
        "--metrics-address",
        f"127.0.0.1:{port}",
    ]
    env = {"PATH": str(Path(sys.executable).parent)}
    launched = start(argv, env, tmp_path / "kernel.log")
    try:
        ready = wait_ready(launched, f"{base}/readyz")
        assert "reading /dev/kmsg" in str(ready["loops"]["producer-kernel"]["why"])  # type: ignore[index]

        def beat_ago() -> float:
            _, body = probe(f"{base}/healthz")
            assert body is not None
            return float(body["loops"]["producer-kernel"]["last_beat_s_ago"])  # type: ignore[index]

        # Quiet for a while, then a beat with nothing read: the loop goes round on idle wake-ups too.
        wait_for("a quiet second since the last beat", lambda: beat_ago() >= 1.0, timeout=60)
        wait_for("a beat after it", lambda: beat_ago() < 1.0, timeout=60)
    finally:
        code = stop(launched)
    # SIGTERM is seen at the next wake-up: a clean exit, not the SIGKILL after the grace time.
    assert code == 0, launched.output()
