"""Straggler detector: the node of a job that is persistently slower than its peers.

Pure logic with explicit state; the caller feeds records and a clock (`now`).

Evidence, over a sliding window of `window_s` seconds (samples older than the job's start plus
`warmup_s` are ignored, so compilation and the first steps do not count):

- **Step time** per node: the median ``step_time_s`` of the ranks that run there. In synchronous
  data-parallel training every rank waits for the slowest in each collective, so their printed
  step times are alike; this evidence matters when ranks time their own compute, or when only
  some ranks report.
- **GPU throughput** per GPU: SM clock, power and utilization, each reading divided by the
  median of the job's GPUs in the same 5 s (so a checkpoint or eval pass that slows every GPU
  of the job cancels out), then the window median of those ratios; and whether the GPU reports
  a hardware or thermal slowdown throttle reason (``hw_slowdown``, ``hw_thermal``,
  ``sw_thermal``, ``hw_power_brake`` as producers.gpu_nvml and gpu_dcgm name them, or NVML's
  ``HwThermalSlowdown`` and nvidia-smi's spellings) in at least half of its samples.
  Explanations quote the raw window medians (MHz, W, %).

Robust statistics. For each metric, over all nodes (step time) or all GPUs (GPU metrics) of the
job: the median ``m`` and the median absolute deviation ``MAD``; the modified z-score of a value
``x`` is ``0.6745 (x - m) / MAD`` (Iglewicz and Hoaglin), with MAD floored at 2% of ``m`` so that
peers agreeing to within measurement noise do not make every small difference infinite. A value
is an outlier when it is worse than the peers' median (the other nodes only) by at least
`min_slowdown` (10%) *and* its modified z-score passes `threshold` (3.5) on the bad side. With
only two nodes the z-score cannot tell which one deviates (both sit at the same distance from the
median), so the relative slowdown alone decides there.

A node is a straggler when its step time is an outlier, or one of its GPUs has an outlying SM
clock, or two outlying GPU metrics, or reports a slowdown throttle reason while its SM clock or
power is `min_slowdown` below its peers' (no z-score needed then: the GPU says why). Utilization
alone never decides: NCCL kernels waiting in a collective keep waiting GPUs busy too.

Because every comparison is against the job's own peers, a job that is uniformly slow (all nodes
throttled, a slow model) yields nothing, and neither does a job on a single node. Each straggler
episode yields one anomaly (category ``gpu_hardware`` when the node's GPUs report a hardware or
thermal slowdown, else ``node``; isolate: drain the node); the episode ends once the node has
not been flagged for a whole window, after which a new episode may start.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import zlib
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from schemas.events import Anomaly, GpuSample, ProgressBatch, SchedEvent
from schemas.ids import stable_id
from schemas.vocab import Category
from streams.detectors.hang import job_state_kind
from streams.ranks import rank_ranges

log = logging.getLogger("trainmedic.straggler")

MAD_FLOOR_FRACTION = 0.02
MAX_STEP_SAMPLES_PER_NODE = 20000
MAX_GPU_SAMPLES_PER_NODE = 4096
#: NVML and DCGM number a node's GPUs from 0 (eight or so per node): a larger index is a producer's
#: mistake. The check keys GPUs by node and index in int64 arrays, so such a GPU is left out of the
#: comparison, with a warning naming it, instead of overflowing them (the schema bounds it below
#: only by 0; GPU health still reads it).
MAX_GPU_INDEX = 4095
JOB_TTL_S = 3600.0
_RECENT_BATCHES = 256
_BUCKET_S = 5.0  # GPU readings of one job compared within buckets this long
GPU_SAMPLE_EVERY_S = 2.9  # keep about one GPU sample per node every 3 s
# The GPU metrics compared with the peers: how explanations name them, and the GpuMetrics field.
_METRIC_FIELDS = (("SM clock", "sm_clock_mhz"), ("power", "power_w"), ("utilization", "utilization_pct"))

# Normalised throttle-reason names (lower case, letters only) -> how an operator says it.
# producers.gpu_nvml / gpu_dcgm use dcgm-exporter's clock_event names (hw_thermal, ...);
# NVML's constants and nvidia-smi spell them out (HwThermalSlowdown, "HW Thermal Slowdown").
_SLOWDOWN_REASONS: dict[str, str] = {
    "hwthermal": "HW thermal slowdown",
    "hwthermalslowdown": "HW thermal slowdown",
    "swthermal": "SW thermal slowdown",
    "swthermalslowdown": "SW thermal slowdown",
    "hwpowerbrake": "HW power brake slowdown",
    "hwpowerbrakeslowdown": "HW power brake slowdown",
    "hwslowdown": "HW slowdown",
}
_REASON_PREFIXES = ("nvmlclocksthrottlereason", "nvmlclockseventreason", "clocksthrottlereason", "clockseventreason")

MEANING = (
    "a node persistently slower than its peers holds back every synchronous step of the job; "
    "draining it and restarting elsewhere restores the job's speed"
)


def slowdown_reason(name: str) -> str | None:
    """The operator's name of a HW/thermal slowdown throttle reason, None for other reasons."""
    key = "".join(c for c in name.lower() if c.isalpha())
    for prefix in _REASON_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    return _SLOWDOWN_REASONS.get(key)


# One kept GPU reading of a node: its time, (GPU index, slowdown reasons) of the GPUs that report a
# slowdown throttle reason (most readings: none), the indices of its GPUs (lost ones left out), and for each of
# _METRIC_FIELDS a row of their values (NaN where a GPU does not report it). Each reading is judged
# by every check of the window (about six): a check concatenates the readings' arrays and takes
# the medians with numpy, where reading value by value in Python was the worker's largest cost
# at 2,048 nodes.
_Reading = tuple[float, tuple[tuple[int, frozenset[str]], ...], npt.NDArray[np.int64], npt.NDArray[np.float64]]


@dataclass
class _Job:
    job_id: str
    seen_at: float
    nodes: tuple[str, ...] = ()
    partition: str | None = None
    run_start: float | None = None
    sched_known: bool = False
    steps: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)  # node -> (ts, step time)
    rank_node: dict[int, str] = field(default_factory=dict)
    episodes: dict[str, float] = field(default_factory=dict)  # node -> last time flagged
    episode_count: Counter[str] = field(default_factory=Counter)
    batches: deque[str] = field(default_factory=deque)
    batch_ids: set[str] = field(default_factory=set)
    next_check: float = 0.0


@dataclass(frozen=True)
class _Outlier:
    value: float
    peers: float
    rel: float  # how much worse than the peers, as a fraction (0.38 = 38% worse)


@dataclass
class _Verdict:
    step: _Outlier | None = None
    gpu_metrics: dict[int, dict[str, _Outlier]] = field(default_factory=dict)
    slowdown: dict[int, list[str]] = field(default_factory=dict)  # GPU index -> reasons (persistent)

    @property
    def flagged(self) -> bool:
        return self.step is not None or bool(self.gpu_metrics)


def _kth_without(ordered: Sequence[float], removed: Sequence[float], k: int) -> float:
    """The k-th smallest (from 0) of the multiset `ordered` less `removed` (both sorted; `removed`
    a part of `ordered`). It lies at most len(removed) places after k in `ordered`."""
    for j in range(k, k + len(removed) + 1):
        x = ordered[j]
        if bisect.bisect_right(ordered, x) - bisect.bisect_right(removed, x) >= k + 1:
            return x
    raise ValueError("removed is not part of ordered")


def _peer_medians(values: dict[tuple[str, int], float]) -> dict[str, float]:
    """For each node, the median of the other nodes' values (nodes with no others are left out).
    Equal to statistics.median over the others, without reading all values once per node: a
    256-node job's check spent half its time there."""
    ordered = sorted(values.values())
    own: dict[str, list[float]] = defaultdict(list)
    for (node, _), v in values.items():
        own[node].append(v)
    out: dict[str, float] = {}
    for node, mine in own.items():
        mine.sort()
        n = len(ordered) - len(mine)
        if n == 0:
            continue
        if n % 2:
            out[node] = _kth_without(ordered, mine, n // 2)
        else:
            out[node] = (_kth_without(ordered, mine, n // 2 - 1) + _kth_without(ordered, mine, n // 2)) / 2
    return out


def _group_medians(
    groups: npt.NDArray[np.int64], values: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Each group's median of `values`, as statistics.median takes it (the middle value, or the mean
    of the two middle ones): the groups (sorted), their medians and their sizes."""
    order = np.lexsort((values, groups))
    g, v = groups[order], values[order]
    codes, start, n = np.unique(g, return_index=True, return_counts=True)
    return codes, (v[start + (n - 1) // 2] + v[start + n // 2]) / 2, n


def _per_gpu(
    keys: npt.NDArray[np.int64],
    values: npt.NDArray[np.float64],
    eligible: npt.NDArray[np.int64],
    min_values: int,
    as_key: Callable[[int], tuple[str, int]],
) -> dict[tuple[str, int], float]:
    """(node, GPU) -> the median of its values, for the eligible GPUs with at least `min_values`."""
    codes, medians, n = _group_medians(keys, values)
    keep = np.isin(codes, eligible) & (n >= min_values)
    return {as_key(c): m for c, m in zip(codes[keep].tolist(), medians[keep].tolist(), strict=True)}


def _median_mad(values: Sequence[float]) -> tuple[float, float]:
    m = statistics.median(values)
    mad = statistics.median(abs(v - m) for v in values)
    return m, max(mad, MAD_FLOOR_FRACTION * abs(m), 1e-12)


class StragglerDetector:
    """See the module docstring. Feed `observe_*`; call `check(now)` periodically."""

    name = "straggler"

    def __init__(
        self,
        # A window median flips once more than half the window is bad: 90 s puts a throttled
        # node's verdict ~45 s after it starts (the bench measured ~63 s with 120 s).
        window_s: float = 90.0,
        min_samples: int = 5,
        threshold: float = 3.5,
        min_slowdown: float = 0.10,
        warmup_s: float = 120.0,
        check_every_s: float = 15.0,
    ) -> None:
        if (
            window_s <= 0
            or min_samples < 1
            or threshold <= 0
            or not 0 < min_slowdown < 1
            or warmup_s < 0
            or check_every_s < 0
        ):
            raise ValueError(
                "StragglerDetector: window_s > 0, min_samples >= 1, threshold > 0, 0 < min_slowdown < 1, "
                "warmup_s >= 0, check_every_s >= 0"
            )
        # A job's verdict needs 45 s of evidence over a 90 s window: judging it every 15 s is
        # enough. Each check reads every GPU reading of the window again (at 1,024 nodes, every
        # 6 s made it the worker's largest cost and its event loop fell behind); 15 s adds 4.5 s
        # to a verdict on average. Each job gets its own phase (from its id) so that the checks of
        # a large cluster's jobs spread over the interval instead of all landing on one tick,
        # which would stall the worker's event loop (measured at 1024 nodes).
        self.check_every_s = check_every_s
        self.window_s = window_s
        self.min_samples = min_samples
        self.threshold = threshold
        self.min_slowdown = min_slowdown
        self.warmup_s = warmup_s
        # Evidence must cover 45 s (or half a shorter window): a short burst is not "persistent",
        # and a verdict must still come within a minute of the slowdown starting.
        self.min_span_s = min(window_s / 2, 45.0)
        self._jobs: dict[str, _Job] = {}
        self._ended: dict[str, float] = {}  # job id -> when its end was seen
        self._gpu: dict[str, deque[_Reading]] = {}
        self._odd_index_nodes: set[str] = set()  # warned once each

    # -- inputs ------------------------------------------------------------------------------

    def observe_sched(self, ev: SchedEvent, now: float) -> None:
        if ev.kind != "job" or not ev.job_id:
            return
        kind = job_state_kind(ev.state)
        if kind in ("ended", "paused"):
            # A pause breaks the window's comparability; the resume is a fresh warm-up.
            self._jobs.pop(ev.job_id, None)
            if kind == "ended":
                self._ended[ev.job_id] = now
            return
        if kind != "running":
            return
        self._ended.pop(ev.job_id, None)
        old = self._jobs.get(ev.job_id)
        if old is not None and "REQUEUED" in ev.flags and old.run_start is not None and ev.event_time > old.run_start:
            del self._jobs[ev.job_id]  # a new run: a fresh window and warm-up
        job = self._job(ev.job_id, now)
        if not job.sched_known:
            job.sched_known = True
            job.run_start = ev.event_time if job.run_start is None else min(job.run_start, ev.event_time)
        if ev.nodes:
            job.nodes = tuple(ev.nodes)
        if ev.partition:
            job.partition = ev.partition

    def observe_progress(self, batch: ProgressBatch, now: float) -> None:
        if batch.job_id in self._ended:
            return  # late lines of a finished job: its nodes may already run another one
        job = self._job(batch.job_id, now)
        if batch.event_id in job.batch_ids:
            return  # redelivered
        job.batch_ids.add(batch.event_id)
        job.batches.append(batch.event_id)
        if len(job.batches) > _RECENT_BATCHES:
            job.batch_ids.discard(job.batches.popleft())
        if batch.job_nodes and not job.nodes:
            job.nodes = tuple(batch.job_nodes)
        if batch.partition and not job.partition:
            job.partition = batch.partition
        for s in batch.samples:
            if job.run_start is None:
                job.run_start = s.ts
            if s.node is None:
                continue
            if s.rank is not None:
                job.rank_node[s.rank] = s.node
            if s.phase == "train" and s.step_time_s is not None:
                q = job.steps.get(s.node)
                if q is None:
                    q = job.steps[s.node] = deque(maxlen=MAX_STEP_SAMPLES_PER_NODE)
                q.append((s.ts, s.step_time_s))

    def observe_gpu(self, sample: GpuSample, now: float) -> None:
        q = self._gpu.get(sample.node)
        if q is None:
            q = self._gpu[sample.node] = deque(maxlen=MAX_GPU_SAMPLES_PER_NODE)
        if q and sample.event_time - q[-1][0] < GPU_SAMPLE_EVERY_S:
            # A window median needs tens of readings, not one per second: keeping one every
            # few seconds cut the check's cost (half of the worker at 1024 nodes) by as much.
            return
        gpus = [g for g in sample.gpus if not g.lost and g.index <= MAX_GPU_INDEX]
        if len(gpus) < len(sample.gpus) and sample.node not in self._odd_index_nodes:
            odd = sorted({g.index for g in sample.gpus if g.index > MAX_GPU_INDEX})
            if odd:
                self._odd_index_nodes.add(sample.node)
                log.warning(
                    "straggler check: node %s reports GPU index %s, above %d; that GPU is left out of the "
                    "comparison (is its producer numbering GPUs as NVML does?)",
                    sample.node,
                    ",".join(map(str, odd[:4])),
                    MAX_GPU_INDEX,
                )
        indices = np.fromiter((g.index for g in gpus), dtype=np.int64, count=len(gpus))
        values = np.array(
            [[np.nan if (v := getattr(g, attr)) is None else v for g in gpus] for _, attr in _METRIC_FIELDS],
            dtype=np.float64,
        ).reshape(len(_METRIC_FIELDS), len(gpus))
        slow = tuple(
            (g.index, reasons)
            for g in gpus
            if g.throttle_reasons and (reasons := frozenset(r for x in g.throttle_reasons if (r := slowdown_reason(x))))
        )
        q.append((sample.event_time, slow, indices, values))
        while q and q[0][0] < sample.event_time - self.window_s:
            q.popleft()

    # -- output ------------------------------------------------------------------------------

    def check(self, now: float) -> list[Anomaly]:
        out: list[Anomaly] = []
        for job in list(self._jobs.values()):
            if not job.sched_known and now - job.seen_at > JOB_TTL_S:
                del self._jobs[job.job_id]
                continue
            if now < job.next_check:
                continue
            job.next_check = now + self.check_every_s
            nodes = job.nodes or tuple(sorted(job.steps))
            verdicts = self._verdicts(job, nodes, now) if len(nodes) >= 2 else {}
            for node, v in verdicts.items():
                if not v.flagged:
                    continue
                if node not in job.episodes:
                    job.episode_count[node] += 1
                    out.append(self._anomaly(job, nodes, node, v, now))
                job.episodes[node] = now
            for node in [n for n, last in job.episodes.items() if now - last >= self.window_s]:
                del job.episodes[node]
        for job_id in [j for j, t in self._ended.items() if now - t > JOB_TTL_S]:
            del self._ended[job_id]
        return out

    # -- internals ---------------------------------------------------------------------------

    def _job(self, job_id: str, now: float) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            phase = (zlib.crc32(job_id.encode()) % 1000) / 1000 * self.check_every_s
            job = self._jobs[job_id] = _Job(job_id=job_id, seen_at=now, next_check=now + phase)
        job.seen_at = now
        return job

    def _lo(self, job: _Job, now: float) -> float:
        lo = now - self.window_s
        if job.run_start is not None:
            lo = max(lo, job.run_start + self.warmup_s)
        return lo

    def _persistent(self, ts: Sequence[float]) -> bool:
        return len(ts) >= self.min_samples and ts[-1] - ts[0] >= self.min_span_s

    def _outliers(self, values: dict[tuple[str, int], float], higher_is_worse: bool) -> dict[tuple[str, int], _Outlier]:
        """Outliers among per-(node, GPU or -1) medians, judged against the other nodes' values."""
        by_node: dict[str, list[float]] = defaultdict(list)
        for (node, _), v in values.items():
            by_node[node].append(v)
        if len(by_node) < 2:
            return {}
        m, mad = _median_mad(list(values.values()))
        peers = _peer_medians(values)
        out: dict[tuple[str, int], _Outlier] = {}
        for key, x in values.items():
            p = peers[key[0]]
            if p <= 0:
                continue
            rel = (x - p) / p if higher_is_worse else (p - x) / p
            z = 0.6745 * (x - m) / mad
            bad_z = z >= self.threshold if higher_is_worse else z <= -self.threshold
            if rel >= self.min_slowdown and (len(by_node) < 3 or bad_z):
                out[key] = _Outlier(value=x, peers=p, rel=rel)
        return out

    def _verdicts(self, job: _Job, nodes: tuple[str, ...], now: float) -> dict[str, _Verdict]:
        lo = self._lo(job, now)
        verdicts: dict[str, _Verdict] = {n: _Verdict() for n in nodes}

        step_medians: dict[tuple[str, int], float] = {}
        for node in nodes:
            q = job.steps.get(node)
            if not q:
                continue
            while q and q[0][0] < now - self.window_s:
                q.popleft()
            pts = sorted((t, v) for t, v in q if t >= lo)
            if self._persistent([t for t, _ in pts]):
                step_medians[(node, -1)] = statistics.median(v for _, v in pts)
        for (node, _), o in self._outliers(step_medians, higher_is_worse=True).items():
            verdicts[node].step = o

        # Each GPU reading is judged against the job's other GPUs at the same moment (5 s
        # buckets): a checkpoint or an eval pass drops every GPU of the job at once and must
        # not make a straggler out of whichever GPUs happened to sample more of it.
        names = list(dict.fromkeys(nodes))  # a node listed twice is still one node
        window = [
            (pos, t, slow, indices, values)
            for pos, node in enumerate(names)
            for t, slow, indices, values in self._gpu.get(node, ())
            if lo <= t <= now
        ]
        if not window:
            return verdicts
        # One entry per (reading, GPU): which node and GPU, when, in which bucket.
        counts = np.fromiter((len(w[3]) for w in window), dtype=np.int64, count=len(window))
        gpu_index = np.concatenate([w[3] for w in window])
        values = np.concatenate([w[4] for w in window], axis=1)
        node_pos = np.repeat(np.fromiter((w[0] for w in window), dtype=np.int64, count=len(window)), counts)
        ts = np.repeat(np.fromiter((w[1] for w in window), dtype=np.float64, count=len(window)), counts)
        bucket = np.floor_divide(ts, _BUCKET_S).astype(np.int64)
        stride = int(gpu_index.max(initial=0)) + 1
        key = node_pos * stride + gpu_index

        def as_key(code: int) -> tuple[str, int]:
            return names[code // stride], code % stride

        # Persistent: enough readings of the GPU, spanning enough time (the entries of a GPU are in
        # time order: each node's readings are).
        order = np.argsort(key, kind="stable")
        codes, first, n = np.unique(key[order], return_index=True, return_counts=True)
        span = ts[order][first + n - 1] - ts[order][first]
        persistent = (n >= self.min_samples) & (span >= self.min_span_s)
        eligible_codes = codes[persistent]
        eligible = {as_key(c) for c in eligible_codes.tolist()}
        reasons: dict[int, Counter[str]] = defaultdict(Counter)
        for pos, _, slow, _, _ in window:
            for index, said in slow:
                reasons[pos * stride + index].update(said)
        readings_of = dict(zip(codes.tolist(), n.tolist(), strict=True))
        for code, counted in reasons.items():
            k = as_key(code)
            persistent_reasons = sorted(r for r, c in counted.items() if c * 2 >= readings_of[code])
            if k in eligible and persistent_reasons:
                verdicts[k[0]].slowdown[k[1]] = persistent_reasons
        # Metric by metric: each bucket's median over the job's GPUs (of at least two nodes), each
        # value's ratio to its bucket's median, then each GPU's medians over the window.
        raw: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = {}
        ratio: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = {}
        for i, (metric, _) in enumerate(_METRIC_FIELDS):
            v = values[i]
            have = ~np.isnan(v)
            v, b, k, pos = v[have], bucket[have], key[have], node_pos[have]
            buckets, b_inv = np.unique(b, return_inverse=True)
            node_buckets = np.unique(b_inv * len(names) + pos)
            nodes_in = np.bincount(node_buckets // len(names), minlength=len(buckets))
            _, b_median, _ = _group_medians(b_inv, v)
            m = np.where(nodes_in >= 2, b_median, np.nan)[b_inv]
            usable = m > 0  # NaN compares False: a bucket of one node gives no ratio
            raw[metric] = (k, v)
            ratio[metric] = (k[usable], v[usable] / m[usable])
        outliers: dict[str, dict[tuple[str, int], _Outlier]] = {}
        for metric in ("SM clock", "power", "utilization"):
            # Decided on each GPU's median ratio to its peers of the moment (1.0: like them).
            medians = _per_gpu(*ratio[metric], eligible_codes, self.min_samples, as_key)
            outliers[metric] = self._outliers(medians, higher_is_worse=False)
            throttled_keys = [
                k for k in eligible if k not in outliers[metric] and k[1] in verdicts[k[0]].slowdown and k in medians
            ]
            peer_medians = _peer_medians(medians) if throttled_keys else {}
            for key in throttled_keys:
                # A GPU that says it throttles needs only to be measurably worse, not an outlier.
                if key[0] in peer_medians:
                    p = peer_medians[key[0]]
                    x = medians[key]
                    if p > 0 and (p - x) / p >= self.min_slowdown:
                        outliers[metric][key] = _Outlier(value=x, peers=p, rel=(p - x) / p)
            # Operators read MHz, W and %: explain with the raw window medians.
            if not outliers[metric]:
                continue
            raw_medians = _per_gpu(*raw[metric], eligible_codes, 1, as_key)
            raw_peers = _peer_medians(raw_medians)
            for key, o in list(outliers[metric].items()):
                if key in raw_medians and key[0] in raw_peers:
                    outliers[metric][key] = _Outlier(value=raw_medians[key], peers=raw_peers[key[0]], rel=o.rel)
        for key in eligible:
            hits = {metric: o[key] for metric, o in outliers.items() if key in o}
            throttled = key[1] in verdicts[key[0]].slowdown
            # Utilization alone never decides (waiting GPUs spin in NCCL kernels at 100%).
            if "SM clock" in hits or len(hits) >= 2 or (throttled and "power" in hits):
                verdicts[key[0]].gpu_metrics[key[1]] = hits
        return verdicts

    def _anomaly(self, job: _Job, nodes: tuple[str, ...], node: str, v: _Verdict, now: float) -> Anomaly:
        parts: list[str] = []
        throttled = sorted(v.slowdown)
        if throttled:
            names = sorted({r for i in throttled for r in v.slowdown[i]})
            which = f"GPU {throttled[0]}" if len(throttled) == 1 else f"GPUs {','.join(map(str, throttled))}"
            parts.append(f"{', '.join(names)} on {which}")
        units = {"SM clock": "MHz", "power": "W", "utilization": "%"}
        for idx in sorted(v.gpu_metrics, key=lambda i: -max(o.rel for o in v.gpu_metrics[i].values())):
            metric, o = max(v.gpu_metrics[idx].items(), key=lambda kv: kv[1].rel)
            unit = units[metric] if metric == "utilization" else " " + units[metric]
            parts.append(
                f"GPU {idx} {metric} {o.value:.0f}{unit} vs {o.peers:.0f}{unit} on the other nodes ({o.rel:.0%} lower)"
            )
            break
        ranks = [r for r, n in job.rank_node.items() if n == node]
        who = f"its ranks {rank_ranges(ranks)}" if ranks else "its ranks"
        if v.step is not None:
            parts.append(
                f"{who} step {v.step.rel:.0%} slower than the other nodes' median "
                f"({v.step.value:.2f} s vs {v.step.peers:.2f} s)"
            )
        elif ranks:
            parts.append(f"it runs ranks {rank_ranges(ranks)}")
        line = f"{node}: " + "; ".join(parts) + f" over the last {self.window_s:g} s"
        category: Category = "gpu_hardware" if v.slowdown else "node"
        return Anomaly(
            event_id=stable_id("anm", "straggler", job.job_id, job.run_start, node, job.episode_count[node]),
            event_time=now,
            detector=self.name,
            signature="straggler",
            category=category,
            severity="warning",
            role="root",
            isolate=True,
            source="gpu" if v.gpu_metrics or v.slowdown else "job_log",
            provenance="gpu" if v.gpu_metrics or v.slowdown else "job",
            job_id=job.job_id,
            node=node,
            partition=job.partition,
            job_nodes=list(nodes),
            line=line[:4096],
            meaning=MEANING,
        )
