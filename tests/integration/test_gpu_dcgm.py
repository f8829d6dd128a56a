"""dcgm-exporter scraping: the captured-format fixture served by a real HTTP server,
DcgmProducer publishing to the real embedded broker, and an exporter that is not there."""

from __future__ import annotations

import http.server
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from bus.config import consumer_config
from bus.publish import Publisher
from producers.gpu_dcgm import DcgmProducer, DcgmScraper, parse_exposition
from schemas.codec import decode
from schemas.events import GpuMetrics, GpuSample
from schemas.topics import GPU_SAMPLES
from tests.conftest import FIXTURES, wait_for
from trainmedic.stack.broker import EmbeddedBroker, free_port

PROM = FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom"
MIB = 1024 * 1024


class _Exporter(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(body: bytes) -> Iterator[str]:
    handler = type("Exporter", (_Exporter,), {"body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def exporter() -> Iterator[str]:
    yield from serve(Path(PROM).read_bytes())


def gpu(samples: list[GpuSample], node: str, index: int) -> GpuMetrics:
    return next(g for s in samples if s.node == node for g in s.gpus if g.index == index)


def test_scrape_maps_the_exposition(exporter: str) -> None:
    scraper = DcgmScraper(f"{exporter}/metrics")
    samples = scraper.scrape()

    assert sorted(s.node for s in samples) == ["gpu01", "gpu02"]
    for s in samples:
        assert s.collector == "dcgm" and [g.index for g in s.gpus] == list(range(8))
        assert all(g.uuid and g.uuid.startswith("GPU-") and g.pci_bus_id for g in s.gpus)
        assert all(not g.lost for g in s.gpus)
    g0 = gpu(samples, "gpu01", 0)
    assert g0.pci_bus_id == "00000000:18:00.0" and g0.uuid == "GPU-accc1826-bd71-4574-6e7c-a948d36f8d97"
    assert (g0.utilization_pct, g0.temperature_c, g0.power_w) == (100.0, 44.0, 655.0)
    assert (g0.sm_clock_mhz, g0.mem_clock_mhz) == (1980.0, 2619.0)
    assert g0.memory_used_bytes == 74213 * MIB and g0.memory_total_bytes == 81559 * MIB
    assert g0.throttle_reasons == [] and g0.xid_events == [] and g0.nvlink_errors == 0
    assert (g0.ecc_sbe_volatile, g0.ecc_dbe_volatile, g0.ecc_sbe_aggregate, g0.ecc_dbe_aggregate) == (0, 0, 0, 0)
    assert (g0.retired_pages_pending, g0.remapped_rows_pending, g0.remapped_rows_failed) == (False, False, False)

    hot = gpu(samples, "gpu01", 5)
    assert hot.throttle_reasons == ["sw_thermal", "hw_thermal"] and hot.temperature_c == 89.0
    assert hot.power_w == 412.5 and hot.sm_clock_mhz == 1275.0
    assert gpu(samples, "gpu01", 2).throttle_reasons == ["power_cap"]
    assert gpu(samples, "gpu01", 6).nvlink_errors == 15
    assert gpu(samples, "gpu01", 1).pcie_replay_count == 2

    bad = gpu(samples, "gpu02", 3)
    assert bad.xid_events == [48] and bad.throttle_reasons == ["hw_slowdown"]
    assert (bad.ecc_dbe_volatile, bad.ecc_sbe_volatile, bad.ecc_dbe_aggregate) == (1, 3, 1)
    assert bad.remapped_rows_pending is True and bad.remapped_rows_failed is False
    assert [g.index for s in samples for g in s.gpus if g.xid_events] == [3]

    # The exporter keeps printing the last Xid: it is reported once, not every scrape.
    again = scraper.scrape()
    assert all(g.xid_events == [] for s in again for g in s.gpus)


def test_blank_values_and_mig_rows() -> None:
    text = """# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A30",Hostname="n1"} 9223372036854775794
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A30",Hostname="n1"} 140737488355328
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="3",Hostname="n1"} 0
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A30",GPU_I_PROFILE="1g.6gb",GPU_I_ID="4",Hostname="n1"} 43
"""
    (g,) = parse_exposition(text, "fallback")["n1"]
    assert g.temperature_c is None and g.power_w is None  # DCGM blank sentinels, not huge numbers
    assert g.xid_events == [43] and g.uuid == "GPU-a" and g.pci_bus_id is None
    assert g.memory_total_bytes is None and g.nvlink_errors is None
    no_host = text.replace(',Hostname="n1"', "")
    assert list(parse_exposition(no_host, "fallback")) == ["fallback"]


def test_dcgm_producer_publishes_one_sample_per_node(broker: EmbeddedBroker, exporter: str) -> None:
    publisher = Publisher(broker.bootstrap, "test-dcgm")
    producer = DcgmProducer(publisher, f"{exporter}/metrics", interval_s=0.2)
    stop = threading.Event()
    worker = threading.Thread(target=producer.run, args=(stop,), daemon=True)
    worker.start()
    try:
        wait_for("three scrapes", lambda: producer.scrapes >= 3)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not worker.is_alive()
    assert producer.errors == 0 and producer.samples == 2 * producer.scrapes
    assert publisher.flush(10) == 0

    consumer = Consumer(consumer_config(broker.bootstrap, f"test-dcgm-{uuid.uuid4().hex}", "test-dcgm"))
    consumer.subscribe([GPU_SAMPLES.name])
    records: list[tuple[bytes | None, GpuSample]] = []

    def all_read() -> bool:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            records.append((msg.key(), decode(GpuSample, msg.value() or b"")))
        return len(records) >= producer.samples

    try:
        wait_for("every published GpuSample", all_read, timeout=60, interval=0)
    finally:
        consumer.close()
    assert len(records) == producer.samples
    assert all(key == s.node.encode() for key, s in records)
    assert sorted({s.node for _, s in records}) == ["gpu01", "gpu02"]
    assert all(s.collector == "dcgm" and len(s.gpus) == 8 for _, s in records)
    xids = [(s.node, g.index, g.xid_events) for _, s in records for g in s.gpus if g.xid_events]
    assert xids == [("gpu02", 3, [48])]


def test_unreachable_exporter_is_counted_not_fatal(broker: EmbeddedBroker) -> None:
    publisher = Publisher(broker.bootstrap, "test-dcgm")
    refused = DcgmProducer(publisher, f"http://127.0.0.1:{free_port()}/metrics", interval_s=0.05, timeout_s=2)
    stop = threading.Event()
    worker = threading.Thread(target=refused.run, args=(stop,), daemon=True)
    worker.start()
    try:
        wait_for("three failed scrapes", lambda: refused.errors >= 3)
        assert worker.is_alive()
    finally:
        stop.set()
        worker.join(timeout=30)
    assert refused.samples == 0 and refused.scrapes == 0
    assert refused.last_error is not None and "refused" in refused.last_error.lower()


def test_wrong_path_and_garbage_are_counted(broker: EmbeddedBroker, exporter: str) -> None:
    publisher = Publisher(broker.bootstrap, "test-dcgm")
    wrong = DcgmProducer(publisher, f"{exporter}/nope", interval_s=1)
    assert wrong.poll_once() == 0 and wrong.errors == 1
    assert wrong.last_error is not None and "HTTP 404" in wrong.last_error
    for garbage_url in serve(b"DCGM_FI_DEV_GPU_TEMP{gpu=0 not prometheus\n"):
        garbage = DcgmProducer(publisher, f"{garbage_url}/metrics", interval_s=1)
        assert garbage.poll_once() == 0 and garbage.errors == 1
        assert garbage.last_error is not None and "not a Prometheus exposition" in garbage.last_error
    for html_url in serve(b"<html><body>dcgm-exporter</body></html>\n"):
        empty = DcgmProducer(publisher, f"{html_url}/metrics", interval_s=1)
        assert empty.poll_once() == 0 and empty.errors == 1
        assert empty.last_error is not None and "no DCGM GPU series" in empty.last_error
