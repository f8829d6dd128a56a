"""InfiniBand / RoCE port state and error counters from the kernel's sysfs -> net.ports.

One NetPortSample per node per interval carries every port of every RDMA device, as the GPU
producer's GpuSample carries every GPU. What is read, per port, is the kernel's stable ABI
(Documentation/ABI/stable/sysfs-class-infiniband, torvalds/linux at commit 031616c434db05ce766f76c62865f55698e0924f;
the formats are those of drivers/infiniband/core/sysfs.c, torvalds/linux at commit
0147ebcf8927f09e1923114092f6b14c1de75a95, which prints them):

    /sys/class/infiniband/<device>/ports/<n>/state       "%d: %s"  e.g. "4: ACTIVE" (NOP, DOWN, INIT,
                                                           ARMED, ACTIVE, ACTIVE_DEFER; "UNKNOWN" beyond)
    /sys/class/infiniband/<device>/ports/<n>/phys_state  "%d: %s"  e.g. "5: LinkUp" (1 Sleep, 2 Polling,
                                                           3 Disabled, 4 PortConfigurationTraining,
                                                           5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test)
    /sys/class/infiniband/<device>/ports/<n>/rate        "%d%s Gb/sec (%dX%s)" e.g. "100 Gb/sec (4X EDR)",
                                                           "2.5 Gb/sec (1X)"
    /sys/class/infiniband/<device>/ports/<n>/link_layer  "InfiniBand", "Ethernet" (RoCE) or "Unknown"
                                                           (ABI: since v2.6.37)
    /sys/class/infiniband/<device>/ports/<n>/counters/*  one unsigned decimal a file ("%u" / "%llu"):
                                                           the port's PMA PortCounters; "N/A (no PMA)"
                                                           where the device answers no PMA query
    /sys/class/infiniband/<device>/ports/<n>/hw_counters/*  optional (ABI: since 4.6), driver-defined
                                                           counters, one number a file, plus `lifespan`
                                                           (the refresh period in ms: a setting, not a
                                                           counter, left out)

The ABI document names the receive-side constraint counter `port_rcv_contraint_errors` (sic); the
kernel creates it as `port_rcv_constraint_errors` (sysfs.c's PORT_PMA_ATTR list): the file name
is taken as the directory lists it, whichever it is.

A file that cannot be read (permission, the device gone mid-read) or whose text is not in the
documented form leaves its field None (a counter: absent) and is named in the port's `error`:
one bad file never costs the sample, and a garbled "state" is never read as DOWN. The sysfs root
is a setting (`ib_sysfs_root`), so tests and containers can point the reader at another tree.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from bus.publish import Publisher
from producers.metrics import POLL_FAILURES, ProducerHealth
from schemas.errors import Unavailable
from schemas.events import NetPort, NetPortSample
from schemas.ids import check_node_name, stable_id
from schemas.topics import NET_PORTS

log = logging.getLogger("trainmedic.net.ib")

DEFAULT_ROOT = Path("/sys/class/infiniband")
# "%d: %s" (state_show, phys_state_show); phys_state names contain a space ("Phy Test").
_CODED = re.compile(r"^(\d+): (\S.*)$")
# "%d%s Gb/sec (%dX%s)" (rate_show): "100 Gb/sec (4X EDR)", "2.5 Gb/sec (1X)".
_RATE = re.compile(r"^(\d+(?:\.\d+)?) Gb/sec \((\d+)X(?: ?\S+)?\)$")
_UNSIGNED = re.compile(r"^\d+$")
NO_PMA = "N/A (no PMA)"
# Files of a hw_counters directory that are not counters.
_NOT_COUNTERS = frozenset({"lifespan"})
# A sysfs attribute is at most one page; anything longer is not what the ABI describes.
_MAX_READ = 4096


class IbSysfsUnavailable(Unavailable, RuntimeError):
    """No InfiniBand sysfs tree to read on this machine (no RDMA driver loaded, wrong root)."""


class _Unreadable(Unavailable):
    pass


def _read(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_READ + 1)
    except OSError as exc:
        raise _Unreadable(f"{path.name}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > _MAX_READ:
        raise _Unreadable(f"{path.name}: longer than a sysfs attribute ({_MAX_READ} bytes)")
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise _Unreadable(f"{path.name}: not text") from None


def parse_coded(text: str, name: str) -> tuple[int, str]:
    """ "4: ACTIVE" -> (4, "ACTIVE"); anything else is _Unreadable naming the file."""
    m = _CODED.match(text)
    if m is None:
        raise _Unreadable(f"{name}: {text[:60]!r} is not in the form '<number>: <name>'")
    return int(m.group(1)), m.group(2)


def parse_rate(text: str) -> float:
    m = _RATE.match(text)
    if m is None:
        raise _Unreadable(f"rate: {text[:60]!r} is not in the form '<Gb/s> Gb/sec (<width>X<speed>)'")
    return float(m.group(1))


def _counters(folder: Path, skip: frozenset[str], problems: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        problems.append(f"{folder.name}/: cannot list: {exc.strerror or exc}")
        return out
    for name in names:
        if name in skip:
            continue
        try:
            text = _read(folder / name)
        except _Unreadable as exc:
            problems.append(f"{folder.name}/{exc}")
            continue
        if text == NO_PMA:
            continue  # the device answers no PMA query: unknown, not an error of the port
        if not _UNSIGNED.match(text):
            problems.append(f"{folder.name}/{name}: {text[:60]!r} is not an unsigned number")
            continue
        out[name] = int(text)
    return out


def read_port(device: str, port_dir: Path) -> NetPort:
    """One port's files; every unreadable or malformed one named in `error`, the rest kept."""
    problems: list[str] = []
    coded: dict[str, tuple[int, str] | None] = {}
    for name in ("state", "phys_state"):
        try:
            coded[name] = parse_coded(_read(port_dir / name), name)
        except _Unreadable as exc:
            problems.append(str(exc))
            coded[name] = None
    rate: str | None = None
    rate_gbps: float | None = None
    try:
        rate = _read(port_dir / "rate")
        rate_gbps = parse_rate(rate)
    except _Unreadable as exc:
        problems.append(str(exc))
    link_layer: str | None = None
    try:
        link_layer = _read(port_dir / "link_layer")[:32] or None
    except _Unreadable as exc:
        problems.append(str(exc))
    counters = _counters(port_dir / "counters", frozenset(), problems) if (port_dir / "counters").is_dir() else {}
    hw_dir = port_dir / "hw_counters"
    hw = _counters(hw_dir, _NOT_COUNTERS, problems) if hw_dir.is_dir() else None
    state, phys = coded["state"], coded["phys_state"]
    return NetPort(
        device=device,
        port=int(port_dir.name),
        link_layer=link_layer,
        state=state[1][:32] if state else None,
        state_code=state[0] if state else None,
        phys_state=phys[1][:64] if phys else None,
        phys_state_code=phys[0] if phys else None,
        rate=rate[:64] if rate is not None else None,
        rate_gbps=rate_gbps,
        counters=counters,
        hw_counters=hw,
        error="; ".join(problems)[:2000] or None,
    )


class IbSysfsCollector:
    """Reads every port of every device under the sysfs root (default /sys/class/infiniband)."""

    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise IbSysfsUnavailable(
                f"{self.root} does not exist: no InfiniBand / RoCE device driver is loaded on this host "
                "(or the sysfs root setting ib_sysfs_root points elsewhere)"
            )

    def ports(self) -> list[NetPort]:
        out: list[NetPort] = []
        try:
            devices = sorted(os.listdir(self.root))
        except OSError as exc:
            raise IbSysfsUnavailable(f"{self.root}: cannot list: {exc.strerror or exc}") from None
        for device in devices:
            ports_dir = self.root / device / "ports"
            try:
                numbers = sorted((n for n in os.listdir(ports_dir) if n.isdigit()), key=int)
            except OSError as exc:
                # A device without a ports directory (or gone between the two listings): no port to report.
                log.warning("%s: cannot list ports: %s", device, exc)
                continue
            for number in numbers:
                if int(number) > 255:
                    continue
                out.append(read_port(device, ports_dir / number))
        return out

    def sample(self, node: str) -> NetPortSample:
        ts = time.time()
        return NetPortSample(
            event_id=stable_id("net", node, "sysfs", f"{ts:.6f}"),
            event_time=ts,
            node=node,
            ports=self.ports(),
            collector="sysfs",
        )


class IbSysfsProducer:
    """Publishes this node's NetPortSamples every interval; never stops on a read or Kafka error."""

    def __init__(
        self,
        publisher: Publisher,
        node: str | None = None,
        interval_s: float = 10.0,
        collector: IbSysfsCollector | None = None,
        root: Path = DEFAULT_ROOT,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.node = check_node_name(node or socket.gethostname(), "node name of the IB producer")
        self.publisher = publisher
        self.interval_s = interval_s
        self.collector = collector if collector is not None else IbSysfsCollector(root)
        self.samples = 0  # published
        self.errors = 0  # intervals whose reading failed or was not published
        self.port_errors = 0  # port readings with an unreadable or malformed file, over published samples
        self.last_error: str | None = None

    def poll_once(self) -> NetPortSample | None:
        """Read every port and publish the sample; the sample, or None when it failed."""
        try:
            sample = self.collector.sample(self.node)
            self.publisher.publish(NET_PORTS, sample)
        except Exception as exc:  # a producer that dies on one bad interval sees nothing afterwards
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            POLL_FAILURES.labels("ib", "sample").inc()
            log.exception("InfiniBand port sample on %s failed", self.node)
            return None
        self.samples += 1
        self.port_errors += sum(1 for p in sample.ports if p.error)
        return sample

    def run(self, stop_event: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        """Sample at a fixed rate until stop_event is set; a slow interval skips ahead."""
        next_at = clock()
        liveness = ProducerHealth("ib", self.interval_s)
        try:
            while not stop_event.is_set():
                published = self.samples
                if self.poll_once() is None:
                    liveness.failed(f"InfiniBand port sample failed: {self.last_error}")
                else:
                    liveness.ok(self.samples - published, "sysfs readable, sampling")
                next_at += self.interval_s
                now = clock()
                if next_at < now:
                    next_at = now
                stop_event.wait(next_at - now)
        finally:
            liveness.stop()
            self.publisher.flush(5.0)

    def close(self) -> None:
        pass

    def __enter__(self) -> IbSysfsProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
