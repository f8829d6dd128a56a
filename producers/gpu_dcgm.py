"""GPU metrics scraped from dcgm-exporter (`http://HOST:9400/metrics`) -> gpu.samples.

dcgm-exporter prints one Prometheus series per DCGM field per GPU, labelled
`gpu` (index), `UUID`, `pci_bus_id`, `Hostname`, ... . The series are grouped by
Hostname into one GpuSample per node (collector "dcgm") with the same fields the
NVML producer fills. Which DCGM field feeds which GpuMetrics field is the data
table DCGM_FIELDS. The exporter's default counters leave ECC, NVLink-error,
retired-page and throttle fields commented out: enable them in its counters CSV
(`-f`) or those fields stay None here.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from bus.publish import Publisher
from producers.gpu_nvml import decode_throttle_reasons
from producers.metrics import SCRAPE_FAILURES, ProducerHealth
from schemas.errors import Unavailable
from schemas.events import GpuMetrics, GpuSample
from schemas.ids import check_node_name, is_node_name, stable_id
from schemas.topics import GPU_SAMPLES

log = logging.getLogger("trainmedic.gpu.dcgm")

MIB = 1024 * 1024
# DCGM reports "blank" / not-supported values as sentinels: DCGM_FP64_BLANK is 2**47 (and a few
# above it), the int64 ones are near 2**63. No field mapped here gets anywhere near 2**47.
DCGM_BLANK_FLOOR = float(2**47)
MAX_BODY_BYTES = 32 * MIB
# The `gpu` label is an index: ASCII digits only (str.isdigit() also takes '²', which int() refuses).
_GPU_INDEX = re.compile(r"[0-9]{1,6}")
# orjson writes integers up to 64 bits; a reading past that is not a real one.
_INT64 = range(-(2**63), 2**63)


@dataclass(frozen=True)
class DcgmField:
    """Where one DCGM field goes. Targets starting with "_" are intermediate values
    (framebuffer parts, last Xid) that `parse_exposition` turns into GpuMetrics fields."""

    target: str
    convert: Callable[[float], Any]
    combine: Literal["first", "sum"] = "first"  # several fields feeding one target


def _flag(value: float) -> bool:
    return value > 0


DCGM_FIELDS: dict[str, DcgmField] = {
    "DCGM_FI_DEV_GPU_UTIL": DcgmField("utilization_pct", float),
    "DCGM_FI_DEV_FB_USED": DcgmField("memory_used_bytes", lambda v: int(v) * MIB),
    "DCGM_FI_DEV_FB_FREE": DcgmField("_fb_free", lambda v: int(v) * MIB),
    "DCGM_FI_DEV_FB_RESERVED": DcgmField("_fb_reserved", lambda v: int(v) * MIB),
    "DCGM_FI_DEV_FB_TOTAL": DcgmField("_fb_total", lambda v: int(v) * MIB),
    "DCGM_FI_DEV_GPU_TEMP": DcgmField("temperature_c", float),
    "DCGM_FI_DEV_POWER_USAGE": DcgmField("power_w", float),
    "DCGM_FI_DEV_SM_CLOCK": DcgmField("sm_clock_mhz", float),
    "DCGM_FI_DEV_MEM_CLOCK": DcgmField("mem_clock_mhz", float),
    # Field 112 under its pre-3.3 and current names; same bits as NVML's clock event reasons.
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": DcgmField("throttle_reasons", lambda v: decode_throttle_reasons(int(v))),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": DcgmField("throttle_reasons", lambda v: decode_throttle_reasons(int(v))),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": DcgmField("ecc_sbe_volatile", int),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": DcgmField("ecc_dbe_volatile", int),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": DcgmField("ecc_sbe_aggregate", int),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": DcgmField("ecc_dbe_aggregate", int),
    "DCGM_FI_DEV_RETIRED_PENDING": DcgmField("retired_pages_pending", _flag),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": DcgmField("remapped_rows_pending", _flag),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": DcgmField("remapped_rows_failed", _flag),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": DcgmField("pcie_replay_count", int),
    # The same four all-link totals the NVML producer sums.
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": DcgmField("nvlink_errors", int, "sum"),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": DcgmField("nvlink_errors", int, "sum"),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": DcgmField("nvlink_errors", int, "sum"),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": DcgmField("nvlink_errors", int, "sum"),
    # The value is the LAST Xid seen on the GPU (0: none), not a count.
    "DCGM_FI_DEV_XID_ERRORS": DcgmField("_last_xid", int),
}
# Read by dcgm-exporter's defaults but without a GpuMetrics field yet (counts, not the pending/failed flags).
UNMAPPED_FIELDS = ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS")


class ScrapeError(Unavailable, RuntimeError):
    pass


@functools.lru_cache(maxsize=4096)
def _labels_of(label_set: str) -> dict[str, str]:
    """prometheus-client's parse of one `{...}` label set. Cached: a scrape repeats each GPU's
    label set once per field, and label parsing is nearly all of the parser's time (~45 us a
    series). Callers must not modify the returned dict."""
    family = next(iter(text_string_to_metric_families(f"x{label_set} 0\n")))
    return dict(family.samples[0].labels)


def _series(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(field, labels, value) of every series whose field is in DCGM_FIELDS.

    Lines are split by the exposition grammar `name{labels} value [timestamp]`; labels go
    through prometheus-client's parser. Comment, HELP and TYPE lines carry nothing we map.
    """
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        start = line.find("{")
        if start <= 0 or line[:start] not in DCGM_FIELDS:
            continue  # every dcgm-exporter series has labels; the rest is not ours
        end = line.rfind("}")
        rest = line[end + 1 :].split() if end > start else []
        try:
            if not rest:
                raise ValueError("no label set end or no value")
            yield line[:start], _labels_of(line[start : end + 1]), float(rest[0])
        except (ValueError, StopIteration) as exc:
            raise ScrapeError(f"not a Prometheus exposition: {exc}: {line[:160]!r}") from None


def parse_exposition(text: str, default_node: str) -> dict[str, list[GpuMetrics]]:
    """GPU readings by node from one exposition text.

    `xid_events` holds the exporter's last Xid when it is non-zero (DcgmScraper
    reports it only when it changes). With MIG, dcgm-exporter repeats device fields
    on every GPU-instance series: the largest value per GPU and field is kept.
    """
    raw: dict[tuple[str, int], dict[str, float]] = {}
    identity: dict[tuple[str, int], tuple[str | None, str | None]] = {}
    for name, labels, value in _series(text):
        gpu_label = labels.get("gpu", "")
        node = labels.get("Hostname") or default_node
        # One bad series is skipped, never the whole scrape. A non-finite value (int(-inf)
        # raises) or one past DCGM's blank sentinels, of either sign, is "not supported": None.
        if (
            not _GPU_INDEX.fullmatch(gpu_label)
            or not is_node_name(node)  # a Hostname label GpuSample.node refuses (schemas.ids)
            or not math.isfinite(value)
            or abs(value) >= DCGM_BLANK_FLOOR
        ):
            continue
        key = (node, int(gpu_label))
        fields = raw.setdefault(key, {})
        fields[name] = max(value, fields.get(name, value))
        if identity.get(key, (None, None)) == (None, None):
            identity[key] = (labels.get("UUID") or None, labels.get("pci_bus_id") or None)
    by_node: dict[str, list[GpuMetrics]] = {}
    for (node, index), fields in sorted(raw.items()):
        by_node.setdefault(node, []).append(_to_metrics(index, fields, *identity.get((node, index), (None, None))))
    return by_node


def _to_metrics(index: int, fields: dict[str, float], uuid: str | None, pci_bus_id: str | None) -> GpuMetrics:
    values: dict[str, Any] = {}
    for name, raw_value in fields.items():
        spec = DCGM_FIELDS[name]
        value = spec.convert(raw_value)
        if spec.combine == "sum":
            values[spec.target] = values.get(spec.target, 0) + value
        else:
            values.setdefault(spec.target, value)
    fb_free, fb_reserved, fb_total = (
        values.pop("_fb_free", None),
        values.pop("_fb_reserved", 0),
        values.pop("_fb_total", None),
    )
    if fb_total is None and fb_free is not None and "memory_used_bytes" in values:
        # used + free leaves out what the driver reserves; older exporters do not print FB_RESERVED.
        fb_total = values["memory_used_bytes"] + fb_free + fb_reserved
    values["memory_total_bytes"] = fb_total
    last_xid = values.pop("_last_xid", 0)
    # Below the blank floor a MiB value can still pass 2**63 bytes: unpublishable, so unknown.
    for target, value in values.items():
        if type(value) is int and value not in _INT64:
            values[target] = None
    return GpuMetrics(
        index=index, uuid=uuid, pci_bus_id=pci_bus_id, xid_events=[last_xid] if last_xid else [], **values
    )


def _default_node(url: str) -> str:
    host = urlparse(url).hostname
    return socket.gethostname() if host in (None, "localhost", "127.0.0.1", "::1") else str(host)


class DcgmScraper:
    """Fetches and maps one exporter; remembers each GPU's last Xid so a Xid is reported once."""

    def __init__(self, url: str, timeout_s: float = 5.0, default_node: str | None = None) -> None:
        if urlparse(url).scheme not in ("http", "https"):
            raise ValueError(f"dcgm-exporter URL must be http(s)://HOST:PORT/metrics, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.default_node = check_node_name(default_node or _default_node(url), "node name of the dcgm producer")
        self._last_xid: dict[tuple[str, int], int] = {}

    def fetch(self) -> str:
        request = urllib.request.Request(self.url, headers={"Accept": "text/plain"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise ScrapeError(f"{self.url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ScrapeError(f"{self.url}: {reason}") from None
        if len(body) > MAX_BODY_BYTES:
            raise ScrapeError(f"{self.url}: response larger than {MAX_BODY_BYTES} bytes")
        return bytes(body).decode("utf-8", errors="replace")

    def samples_from(self, text: str, ts: float | None = None) -> list[GpuSample]:
        ts = time.time() if ts is None else ts
        out = []
        for node, gpus in parse_exposition(text, self.default_node).items():
            fresh = []
            for g in gpus:
                last = g.xid_events[0] if g.xid_events else 0
                previous = self._last_xid.get((node, g.index))
                self._last_xid[(node, g.index)] = last
                fresh.append(g if last and last != previous else g.model_copy(update={"xid_events": []}))
            out.append(
                GpuSample(
                    event_id=stable_id("gpu", node, "dcgm", f"{ts:.6f}"),
                    event_time=ts,
                    node=node,
                    gpus=fresh,
                    collector="dcgm",
                )
            )
        return out

    def scrape(self) -> list[GpuSample]:
        ts = time.time()
        samples = self.samples_from(self.fetch(), ts)
        if not samples:
            # dcgm-exporter answers 200 with no GPU series when it lost DCGM: that is not a healthy scrape.
            raise ScrapeError(f"{self.url}: no DCGM GPU series in the response")
        return samples


class DcgmProducer:
    """Scrapes one dcgm-exporter per interval and publishes one GpuSample per node it reports.

    An exporter that cannot be reached or answers garbage is counted in `errors`
    and logged (first failure, then every 60th in a row), never fatal.
    """

    LOG_EVERY = 60

    def __init__(
        self,
        publisher: Publisher,
        url: str,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        node: str | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.publisher = publisher
        self.scraper = DcgmScraper(url, timeout_s=timeout_s, default_node=node)
        self.interval_s = interval_s
        self.samples = 0  # GpuSamples published
        self.scrapes = 0  # successful scrapes
        self.errors = 0  # failed scrapes or publishes
        self.last_error: str | None = None
        self._failing = 0

    def poll_once(self) -> int:
        try:
            samples = self.scraper.scrape()
            for sample in samples:
                self.publisher.publish(GPU_SAMPLES, sample)
        except Exception as exc:  # one bad scrape must not end the producer
            self.errors += 1
            self._failing += 1
            SCRAPE_FAILURES.labels("dcgm").inc()
            self.last_error = str(exc) if isinstance(exc, ScrapeError) else f"{type(exc).__name__}: {exc}"
            if self._failing % self.LOG_EVERY == 1:
                log.warning("dcgm-exporter scrape failed (%d in a row): %s", self._failing, self.last_error)
            return 0
        if self._failing:
            log.info("dcgm-exporter %s answers again after %d failed scrapes", self.scraper.url, self._failing)
            self._failing = 0
        self.scrapes += 1
        self.samples += len(samples)
        return len(samples)

    def run(self, stop_event: threading.Event) -> None:
        next_at = time.monotonic()
        # Ready once the exporter answered a scrape with GPU series; a round may take the timeout.
        liveness = ProducerHealth("dcgm", self.interval_s, self.scraper.timeout_s)
        try:
            while not stop_event.is_set():
                errors = self.errors
                published = self.poll_once()
                if self.errors > errors:
                    liveness.failed(f"dcgm-exporter scrape failed: {self.last_error}")
                else:
                    liveness.ok(published, f"scraping {self.scraper.url}")
                next_at += self.interval_s
                now = time.monotonic()
                if next_at < now:
                    next_at = now
                stop_event.wait(next_at - now)
        finally:
            liveness.stop()
            self.publisher.flush(5.0)
