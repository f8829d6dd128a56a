"""The InfiniBand / RoCE sysfs reader (producers/ib_sysfs.py) and the port detector
(streams/detectors/net_ports.py).

The reader is pointed at a directory tree laid out exactly as the kernel's stable ABI documents
/sys/class/infiniband (Documentation/ABI/stable/sysfs-class-infiniband, torvalds/linux @ 031616c4),
with each file's text as drivers/infiniband/core/sysfs.c prints it ("4: ACTIVE\\n", "5: LinkUp\\n",
"100 Gb/sec (4X EDR)\\n", one "%u\\n" a counter, "N/A (no PMA)\\n" without a PMA). That tree is the
input data, as a captured log file is for the log producers: it is not a mock of the reader's
code, which opens and reads it with the same calls it uses on a real host.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from producers.ib_sysfs import IbSysfsCollector, IbSysfsProducer, IbSysfsUnavailable
from schemas.events import NetPort, NetPortSample
from schemas.topics import NET_PORTS, partition_key
from streams.catalog import CatalogError
from streams.detectors.net_ports import NetPortDetector, load_net_port_catalog

STATES = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4}
PHYS = {"Sleep": 1, "Polling": 2, "Disabled": 3, "LinkUp": 5, "LinkErrorRecovery": 6}
IB_COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
)


def write_port(
    root: Path,
    device: str,
    port: int,
    state: str = "ACTIVE",
    phys: str = "LinkUp",
    rate: str = "200 Gb/sec (4X HDR)",
    link_layer: str = "InfiniBand",
    counters: dict[str, Any] | None = None,
    hw_counters: dict[str, Any] | None = None,
) -> Path:
    """One port directory, each file's text as the kernel prints it."""
    d = root / device / "ports" / str(port)
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(f"{STATES[state]}: {state}\n")
    (d / "phys_state").write_text(f"{PHYS[phys]}: {phys}\n")
    (d / "rate").write_text(f"{rate}\n")
    (d / "link_layer").write_text(f"{link_layer}\n")
    values = dict.fromkeys(IB_COUNTERS, 0) | (counters or {})
    for name, value in values.items():
        (d / "counters" / name).write_text(f"{value}\n")
    if hw_counters is not None:
        (d / "hw_counters").mkdir(exist_ok=True)
        (d / "hw_counters" / "lifespan").write_text("10\n")
        for name, value in hw_counters.items():
            (d / "hw_counters" / name).write_text(f"{value}\n")
    return d


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """mlx5_0 port 1: InfiniBand, ACTIVE; mlx5_1 port 1: InfiniBand, DOWN/Polling (no cable);
    mlx5_2 port 1: RoCE (link_layer Ethernet), ACTIVE, with hw_counters."""
    root = tmp_path / "infiniband"
    write_port(root, "mlx5_0", 1)
    write_port(root, "mlx5_1", 1, state="DOWN", phys="Polling", rate="10 Gb/sec (4X SDR)")
    write_port(
        root,
        "mlx5_2",
        1,
        rate="100 Gb/sec (2X HDR)",
        link_layer="Ethernet",
        hw_counters={"out_of_sequence": 3, "local_ack_timeout_err": 0, "rx_icrc_encapsulated": 0},
    )
    return root


def by_device(ports: list[NetPort]) -> dict[str, NetPort]:
    return {p.device: p for p in ports}


# --- the reader ------------------------------------------------------------------------------


def test_reads_active_down_and_roce_ports_as_the_abi_prints_them(tree: Path) -> None:
    ports = by_device(IbSysfsCollector(tree).ports())
    assert set(ports) == {"mlx5_0", "mlx5_1", "mlx5_2"}
    ib = ports["mlx5_0"]
    assert (ib.port, ib.state, ib.state_code, ib.phys_state, ib.phys_state_code) == (1, "ACTIVE", 4, "LinkUp", 5)
    assert (ib.rate, ib.rate_gbps, ib.link_layer) == ("200 Gb/sec (4X HDR)", 200.0, "InfiniBand")
    assert ib.counters["symbol_error"] == 0 and len(ib.counters) == len(IB_COUNTERS)
    assert ib.hw_counters is None  # no hw_counters directory: None, not {}
    assert ib.error is None
    down = ports["mlx5_1"]
    assert (down.state, down.state_code, down.phys_state, down.phys_state_code) == ("DOWN", 1, "Polling", 2)
    roce = ports["mlx5_2"]
    assert roce.link_layer == "Ethernet"
    assert roce.hw_counters == {"out_of_sequence": 3, "local_ack_timeout_err": 0, "rx_icrc_encapsulated": 0}
    assert "lifespan" not in roce.hw_counters  # the refresh period, not a counter


def test_a_sample_is_one_node_keyed_record_on_its_topic(tree: Path) -> None:
    sample = IbSysfsCollector(tree).sample("gpu07")
    assert sample.node == "gpu07" and sample.collector == "sysfs" and len(sample.ports) == 3
    assert partition_key(sample) == b"gpu07"
    assert NET_PORTS.event_type is NetPortSample and NET_PORTS.name == "net.ports"


def test_counters_incrementing_are_read_as_they_stand(tree: Path) -> None:
    collector = IbSysfsCollector(tree)
    first = by_device(collector.ports())["mlx5_0"].counters["link_downed"]
    write_port(tree, "mlx5_0", 1, counters={"link_downed": 2, "symbol_error": 65535})
    second = by_device(collector.ports())["mlx5_0"].counters
    assert (first, second["link_downed"], second["symbol_error"]) == (0, 2, 65535)


def test_garbled_and_unreadable_files_are_named_and_the_rest_is_kept(tree: Path) -> None:
    port = tree / "mlx5_0" / "ports" / "1"
    (port / "state").write_text("ACTIVE\n")  # no "<number>: " prefix
    (port / "rate").write_bytes(b"\xff\xfe\n")
    (port / "counters" / "symbol_error").write_text("lots\n")
    (port / "counters" / "link_downed").write_text("N/A (no PMA)\n")
    (port / "counters" / "port_rcv_errors").unlink()
    (port / "counters" / "port_rcv_errors").mkdir()  # a read fails (EISDIR), as a vanished device's would
    ports = by_device(IbSysfsCollector(tree).ports())
    p = ports["mlx5_0"]
    assert p.state is None and p.state_code is None  # unreadable, never DOWN
    assert p.phys_state == "LinkUp" and p.rate is None and p.rate_gbps is None
    assert "symbol_error" not in p.counters and "link_downed" not in p.counters
    assert "port_rcv_errors" not in p.counters and p.counters["link_error_recovery"] == 0
    assert p.error is not None
    for said in ("state: 'ACTIVE' is not in the form", "rate: not text", "counters/symbol_error: 'lots'"):
        assert said in p.error
    assert "counters/port_rcv_errors: cannot read" in p.error
    assert "link_downed" not in p.error  # "N/A (no PMA)" is the kernel saying unknown, not an error
    assert ports["mlx5_1"].error is None  # the other ports are untouched


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_without_read_permission_is_named(tree: Path) -> None:
    (tree / "mlx5_0" / "ports" / "1" / "phys_state").chmod(0)
    p = by_device(IbSysfsCollector(tree).ports())["mlx5_0"]
    assert p.phys_state is None and p.error is not None and "phys_state: cannot read" in p.error


def test_a_missing_root_says_why(tmp_path: Path) -> None:
    with pytest.raises(IbSysfsUnavailable, match="no InfiniBand / RoCE device driver is loaded"):
        IbSysfsCollector(tmp_path / "nothing")


class _Pub:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.sent: list[tuple[str, Any]] = []

    def publish(self, topic: Any, event: Any) -> None:
        if self.fail:
            raise RuntimeError("broker down")
        self.sent.append((topic.name, event))

    def flush(self, timeout: float) -> bool:
        return True


def test_the_producer_publishes_and_survives_a_failed_interval(tree: Path) -> None:
    pub = _Pub()
    producer = IbSysfsProducer(pub, node="gpu07", collector=IbSysfsCollector(tree))  # type: ignore[arg-type]
    assert producer.poll_once() is not None
    assert [t for t, _ in pub.sent] == ["net.ports"] and producer.samples == 1
    pub.fail = True
    assert producer.poll_once() is None
    assert producer.errors == 1 and producer.last_error == "RuntimeError: broker down"


# --- the detector ----------------------------------------------------------------------------


def _sample(i: int, ports: list[NetPort], node: str = "gpu07", t0: float = 1_700_000_000.0) -> NetPortSample:
    return NetPortSample(event_id=f"net-{node}-{i}", event_time=t0 + 10 * i, node=node, ports=ports)


def _port(
    device: str = "mlx5_0", state: str | None = "ACTIVE", phys: str | None = "LinkUp", **counters: int
) -> NetPort:
    return NetPort(
        device=device,
        port=1,
        link_layer="InfiniBand",
        state=state,
        state_code=STATES.get(state or ""),
        phys_state=phys,
        phys_state_code=PHYS.get(phys or ""),
        counters=dict.fromkeys(IB_COUNTERS, 0) | counters,
    )


def test_a_port_down_after_active_is_a_node_keyed_anomaly_once() -> None:
    det = NetPortDetector()
    assert det.observe(_sample(0, [_port()])) == []
    out = det.observe(_sample(1, [_port(state="DOWN", phys="Polling")]))
    assert len(out) == 1
    a = out[0]
    assert (a.detector, a.signature, a.category, a.source, a.node, a.job_id) == (
        "net_ports",
        "net_port_down",
        "interconnect",
        "net",
        "gpu07",
        None,
    )
    assert (a.role, a.severity, a.isolate) == ("root", "critical", True)
    assert a.facts["device"] == "mlx5_0" and a.facts["port"] == "1" and a.facts["link_layer"] == "InfiniBand"
    assert a.facts["state"] == "DOWN" and a.facts["phys_state"] == "Polling"
    assert "gpu07 mlx5_0 port 1 (InfiniBand): state 1: DOWN, phys_state 2: Polling" in a.line
    assert det.observe(_sample(2, [_port(state="DOWN", phys="Polling")])) == []  # the same episode
    assert det.observe(_sample(3, [_port()])) == []  # up again: the episode ends
    again = det.observe(_sample(4, [_port(state="INIT", phys="LinkUp")]))
    assert [x.signature for x in again] == ["net_port_down"]
    assert again[0].event_id != a.event_id


def test_a_port_never_seen_up_is_not_reported_and_unreadable_is_not_down() -> None:
    det = NetPortDetector()
    assert det.observe(_sample(0, [_port(state="DOWN", phys="Polling")])) == []  # an unplugged port
    assert det.observe(_sample(1, [_port(state="DOWN", phys="Disabled")])) == []
    det2 = NetPortDetector()
    det2.observe(_sample(0, [_port()]))
    assert det2.observe(_sample(1, [_port(state=None, phys=None)])) == []


def test_a_port_that_disappears_after_being_up_is_down() -> None:
    det = NetPortDetector()
    det.observe(_sample(0, [_port(), _port("mlx5_1")]))
    out = det.observe(_sample(1, [_port()]))
    assert [(a.signature, a.facts["device"], a.facts["state"]) for a in out] == [("net_port_down", "mlx5_1", "absent")]


def test_steady_counters_give_nothing() -> None:
    det = NetPortDetector()
    busy = {"symbol_error": 3, "link_downed": 1, "port_rcv_errors": 7, "port_xmit_discards": 900}
    for i in range(30):
        steady = _port().model_copy(update={"counters": _port().counters | busy})
        assert det.observe(_sample(i, [steady])) == []


def test_a_link_downed_increment_is_an_anomaly() -> None:
    det = NetPortDetector()
    assert det.observe(_sample(0, [_port(link_downed=4)])) == []  # the first reading is a baseline
    out = det.observe(_sample(1, [_port(link_downed=5)]))
    assert [a.signature for a in out] == ["net_port_link_downed"]
    assert out[0].facts["link_downed_from"] == "4" and out[0].facts["link_downed_to"] == "5"
    assert out[0].source == "net" and out[0].node == "gpu07" and out[0].isolate is False
    assert det.observe(_sample(2, [_port(link_downed=5)])) == []
    assert det.observe(_sample(3, [_port(link_downed=0)])) == []  # cleared: a new baseline


def test_symbol_errors_need_the_catalog_threshold_within_the_window() -> None:
    det = NetPortDetector()
    det.observe(_sample(0, [_port(symbol_error=0)]))
    assert det.observe(_sample(1, [_port(symbol_error=9)])) == []
    out = det.observe(_sample(2, [_port(symbol_error=10)]))
    assert [a.signature for a in out] == ["net_port_symbol_errors"] and out[0].facts["rise"] == "10"
    # Slowly, one every 70 s: never 10 within 10 minutes.
    slow = NetPortDetector()
    for i in range(40):
        assert slow.observe(_sample(7 * i, [_port(symbol_error=i)])) == []


def test_redelivery_gives_the_same_anomalies_and_older_samples_nothing() -> None:
    det = NetPortDetector()
    det.observe(_sample(0, [_port()]))
    first = det.observe(_sample(1, [_port(state="DOWN", phys="Polling")]))
    assert det.observe(_sample(1, [_port(state="DOWN", phys="Polling")])) == first
    assert det.observe(_sample(0, [_port()])) == []


def test_roce_ports_say_so() -> None:
    det = NetPortDetector()
    roce = _port("mlx5_2").model_copy(update={"link_layer": "Ethernet"})
    det.observe(_sample(0, [roce]))
    out = det.observe(_sample(1, [roce.model_copy(update={"state": "DOWN", "phys_state": "Disabled"})]))
    assert out[0].facts["link_layer"] == "Ethernet" and out[0].facts["rdma"] == "RoCE"
    assert "(Ethernet)" in out[0].line


def test_every_catalog_signature_says_net_port_and_the_catalog_is_checked(tmp_path: Path) -> None:
    catalog = load_net_port_catalog()
    assert all(c.signature.startswith("net_port_") and c.category == "interconnect" for c in catalog.conditions)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "conditions:\n  - {id: x, kind: counter, fields: [link_downed], threshold: 0, window_s: null,\n"
        "     signature: net_port_x, title: X, category: interconnect, severity: error, role: root,\n"
        "     isolate: false, meaning: m}\n"
    )
    with pytest.raises(CatalogError, match=r"entry 0 \(id 'x'\): field 'threshold'"):
        load_net_port_catalog(bad)


def test_the_reader_and_the_detector_together(tree: Path) -> None:
    """The tree read twice, the IB port pulled and its link_downed counted between: one sample each."""
    collector, det = IbSysfsCollector(tree), NetPortDetector()
    det.observe(collector.sample("gpu07"))
    write_port(tree, "mlx5_0", 1, state="DOWN", phys="Polling", counters={"link_downed": 1})
    out = det.observe(collector.sample("gpu07"))
    assert sorted(a.signature for a in out) == ["net_port_down", "net_port_link_downed"]
    assert {a.facts["device"] for a in out} == {"mlx5_0"}
