"""Catch-up benchmark (not a test): how fast 1, 2, ... streams workers drain a preloaded backlog.

A fleet of N nodes x 8 GPUs (default 5,000 nodes, 312 jobs of 16 nodes) is simulated by
`sim.cluster` for M minutes of event time (default 2) and published up front, through
`bus.publish.Publisher`, to the embedded Tansu broker, on topics made by the project's own
topic creation (`bus.admin.ensure_topics`, schemas.topics.DEFAULT_PARTITIONS partitions):
one GpuSample per node per second (8 healthy, busy GPUs), one ProgressBatch and LogBatch per
job per training step (Megatron style: the last rank prints), every job's RUNNING first. The
records are the simulator's prebuilt JSON (as bench/pipeline sends them; tests/e2e/
test_bench_smoke.py checks they decode to the same events) sent with Publisher.publish_raw:
building 600,000 pydantic GpuSamples would take minutes of the two cores.

Then, for each worker count W (--workers, default 1,2), W streams workers are started exactly
as `trainmedic up` starts its one (`python -m trainmedic.stack.streams_worker worker --without-web
-l info`), in a consumer group of their own (TRAINMEDIC_STREAMS_ID=trainmedic-streams-
catchup-W-n), so every run reads the same backlog from the beginning (the app resets to
earliest). Each worker serves /metrics on its own port; every 0.5 s the benchmark reads its
`trainmedic_stream_events_total{agent,topic}` and `trainmedic_stream_published_total{topic}`,
and the CPU of every process from /proc. Between runs every topic but the backlog's is deleted
and made again, empty: a new group would otherwise also read the last run's repartition topic.

Drained: every (agent, input topic) counter, summed over the workers, has reached what was
produced on that topic, every agent reading a topic the workers write themselves (a
repartition step, anomalies) has read what they published to it, AND the group's committed
offsets have reached the end of every backlog partition (end = the last offset the broker acknowledged to our producer + 1; the embedded
broker's own end offsets are wrong and are never asked for). A record counted twice (re-read
after a rebalance from the last commit) is reported as a duplicate; when there are any, the
drain time is the commit time (an upper bound: Faust commits every ~2.8 s), else the counters'.

Reported per run: time to drain (from the workers' start, and from the first record consumed),
events/s in total and per worker, which partitions each worker ended with (its log's last
assignment table) and how many records it took per topic, start -> Ready and the group joins
(the rebalance cost), CPU seconds and RSS of every worker and of the broker.

Run: .venv/bin/python -m bench.catchup [--quick] [--nodes 5000] [--minutes 2] [--workers 1,2,4]
Writes bench/results/catchup.json and catchup.md (see --out), and the result in the common format,
bench/results/catchup/<date>-<commit>.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import figures, results
from bench.machine import machine
from bus.publish import Publisher

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
READY_MARK = b"[^Worker]: Ready"
SCRAPE_S = 0.5
JOB_NODES = 16  # every job 16 nodes x 8 GPUs: 312 jobs on 5,000 nodes


# --- /proc ---------------------------------------------------------------------------------------------


def cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads), seconds; None once it is gone."""
    if pid is None:
        return None
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 1e6
    except (OSError, IndexError, ValueError):
        return None


def peak_rss_mb(pid: int | None) -> float | None:
    """VmHWM: the most resident memory the process ever had."""
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB: the same MB as rss_mb
    return None


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, to tell how loaded the cores were."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


# --- preload -------------------------------------------------------------------------------------------


class CountingPublisher(Publisher):
    """The project's Publisher, also counting acknowledged records per partition and the end
    offset of each (the last acknowledged offset + 1): the broker's own end offsets are wrong."""

    def __init__(self, bootstrap: str, client_id: str) -> None:
        # Before the base class starts its delivery thread, which may call back into us.
        self.by_partition: Counter[tuple[str, int]] = Counter()
        self.end_offset: dict[tuple[str, int], int] = {}
        self._count_lock = threading.Lock()
        super().__init__(bootstrap, client_id)

    def _delivery(self, event_id: str) -> Callable[[Any, Any], None]:
        inner = super()._delivery(event_id)

        def on_delivery(err: Any, msg: Any) -> None:
            inner(err, msg)
            if err is None:
                key = (str(msg.topic()), int(msg.partition()))
                with self._count_lock:
                    self.by_partition[key] += 1
                    self.end_offset[key] = max(self.end_offset.get(key, 0), int(msg.offset()) + 1)

        return on_delivery


@dataclass
class Backlog:
    produced: dict[str, int]  # topic -> records the broker acknowledged
    by_partition: dict[str, dict[int, int]]
    end_offset: dict[str, dict[int, int]]
    dropped: dict[str, int]
    jobs: int
    nodes: int
    event_seconds: float
    gen_s: float
    publish_s: float
    main_cpu_s: float
    offsets_consistent: bool  # per partition: records acknowledged == end offset (a fresh topic)

    @property
    def total(self) -> int:
        return sum(self.produced.values())


def preload(bootstrap: str, nodes: int, seconds: float, seed: int, say: Callable[[str], None]) -> Backlog:
    """Simulate `seconds` of the fleet, ending now, and publish all of it before any worker runs."""
    from sim.cluster import ClusterConfig, SimCluster

    publisher = CountingPublisher(bootstrap, "trainmedic-bench-catchup")
    cluster = SimCluster(
        ClusterConfig(
            nodes=nodes,
            seed=seed,
            transport="direct",
            payload="fast",  # prebuilt JSON (bench/pipeline does the same): pydantic would cost minutes here
            job_sizes=((JOB_NODES, 1.0),),
            spare_fraction=0.0,
            min_spare=0,
            # Megatron style: the last rank prints, so one ProgressBatch per job per step (1.5-4.5 s).
            per_node_progress_fraction=0.0,
            # The jobs were running before the backlog starts: no start-up banners, detectors past warm-up.
            backdate_s=seconds + 300.0,
        )
    )
    cpu0 = time.process_time()
    t_start = time.time()
    t0 = t_start - seconds
    cluster.prepare(publisher, now=t0)  # every job's RUNNING (sched.events) first
    t = t0
    tick = cluster.cfg.tick_s
    next_say = time.time() + 10
    while t < t0 + seconds:
        t = min(t + tick, t0 + seconds)
        cluster.step(t)  # event times are the simulated ones: a backlog of the last `seconds`
        # Bounded local queue: librdkafka drops what does not fit (queue.buffering.max.messages).
        while publisher.pending() > 50_000:
            publisher.flush(0.2)
        if time.time() > next_say:
            next_say = time.time() + 10
            say(f"[catchup] preload: {t - t0:.0f} of {seconds:.0f} s of events, {sum(cluster.sent.values()):,} records")
    gen_s = time.time() - t_start
    left = publisher.flush(120)
    publish_s = time.time() - t_start
    if left:
        raise RuntimeError(f"{left} records still unacknowledged after 120 s: the broker is not keeping up")
    by_part: dict[str, dict[int, int]] = defaultdict(dict)
    ends: dict[str, dict[int, int]] = defaultdict(dict)
    for (topic, p), n in sorted(publisher.by_partition.items()):
        by_part[topic][p] = n
        ends[topic][p] = publisher.end_offset[(topic, p)]
    backlog = Backlog(
        produced=dict(sorted(publisher.delivered.items())),
        by_partition=dict(by_part),
        end_offset=dict(ends),
        dropped=dict(publisher.dropped),
        jobs=len(cluster.jobs),
        nodes=nodes,
        event_seconds=seconds,
        gen_s=round(gen_s, 2),
        publish_s=round(publish_s, 2),
        main_cpu_s=round(time.process_time() - cpu0, 2),
        offsets_consistent=all(publisher.end_offset[k] == n for k, n in publisher.by_partition.items()),
    )
    publisher.close(5)
    return backlog


def reset_other_topics(bootstrap: str, keep: set[str], partitions: int, retention_hours: float) -> list[str]:
    """Delete every topic but the backlog's (what the last run's workers wrote: a repartition
    topic, anomalies, their Faust changelogs) and make the project's topics again, empty: the
    next run's group reads from the beginning, and must find the backlog and nothing else."""
    from confluent_kafka.admin import AdminClient

    from bus.admin import ensure_topics
    from bus.config import admin_config

    admin = AdminClient(admin_config(bootstrap))
    doomed = sorted(t for t in admin.list_topics(timeout=10).topics if t not in keep and not t.startswith("__"))
    if doomed:
        for fut in admin.delete_topics(doomed, operation_timeout=30).values():
            fut.result(30)
        deadline = time.monotonic() + 30
        while set(doomed) & set(admin.list_topics(timeout=10).topics):
            if time.monotonic() > deadline:
                raise RuntimeError("the broker still lists deleted topics after 30 s")
            time.sleep(0.2)
    ensure_topics(bootstrap, partitions, retention_hours=retention_hours)
    return doomed


# --- workers -------------------------------------------------------------------------------------------


@dataclass
class Worker:
    index: int
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float
    ready_at: float | None = None
    counts: dict[tuple[str, str], float] = field(default_factory=dict)  # (agent, topic) -> events in
    published: dict[str, float] = field(default_factory=dict)  # topic -> records published
    scrape_errors: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def metric_names() -> tuple[str, str]:
    """The exposed names of streams.metrics.EVENTS_IN (agent, topic) and PUBLISHED (topic), from
    the app's own module: Counters are exposed as `<name>_total`."""
    from streams.metrics import EVENTS_IN, PUBLISHED

    return tuple(f"{next(iter(c.describe())).name}_total" for c in (EVENTS_IN, PUBLISHED))  # type: ignore[return-value]


@dataclass
class Scrape:
    events_in: dict[tuple[str, str], float]  # (agent, topic) -> records consumed
    published: dict[str, float]  # topic -> records the worker published (a repartition step's output)


def scrape(port: int, names: tuple[str, str]) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        body = resp.read().decode()
    got = Scrape({}, {})
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == names[0]:
                got.events_in[(s.labels.get("agent", "?"), s.labels.get("topic", "?"))] = float(s.value)
            elif s.name == names[1]:
                got.published[s.labels.get("topic", "?")] = float(s.value)
    return got


def start_worker(bootstrap: str, group_id: str, index: int, root: Path) -> Worker:
    """One streams worker as trainmedic/stack/runtime.py's Stack._start_worker starts it."""
    from trainmedic.stack.broker import free_port
    from trainmedic.stack.supervisor import die_with_parent

    port = free_port()
    data = root / f"w{index}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    env = dict(os.environ)
    env.update(
        TRAINMEDIC_BOOTSTRAP=bootstrap,
        TRAINMEDIC_STREAMS_DATA_DIR=str(data / "streams"),
        TRAINMEDIC_METRICS_HOST="127.0.0.1",
        TRAINMEDIC_METRICS_PORT=str(port),
        TRAINMEDIC_STREAMS_ID=group_id,
    )
    log_path = root / f"w{index}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainmedic.stack.streams_worker", "worker", "--without-web", "-l", "info"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,  # Ctrl-C goes to the benchmark, which stops the workers in order
            preexec_fn=die_with_parent(),  # a killed benchmark takes its workers with it
        )
    return Worker(index=index, port=port, log_path=log_path, proc=proc, started_at=time.time())


def stop_worker(w: Worker) -> None:
    if w.proc.poll() is None:
        w.proc.send_signal(signal.SIGTERM)
        try:
            w.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
_ROW = re.compile(r"^\|\s*(\S+)\s*\|\s*\{([^}]*)\}\s*\|")


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    # Faust logs local time with milliseconds after a comma.
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _partition_set(text: str) -> list[int]:
    """Faust's '{0-2, 5}' -> [0, 1, 2, 5]."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_worker_log(path: Path) -> dict[str, Any]:
    """Group joins, revocations and every assignment table ('Setting newly assigned partitions')."""
    joins: list[float] = []
    revokes = 0
    group: str | None = None
    assignments: list[dict[str, Any]] = []
    current: dict[str, list[int]] | None = None
    at: float | None = None
    incidents: Counter[str] = Counter()  # category -> incidents this worker published (its log says)
    for line in path.read_text(errors="replace").splitlines():
        if "] incident " in line and " category=" in line:
            incidents[line.split(" category=", 1)[1].split()[0]] += 1
        if current is not None:
            m = _ROW.match(line)
            if m and m.group(1) != "topic":
                current[m.group(1)] = _partition_set(m.group(2))
            if "for group" in line:
                assignments.append({"t": at, "partitions": current})
                current = None
            continue
        if "Joined group '" in line:
            joins.append(_stamp(line) or 0.0)
            group = line.split("Joined group '", 1)[1].split("'", 1)[0]
        elif "Revoking previously assigned partitions" in line:
            revokes += 1
        elif "Setting newly assigned partitions" in line:
            at = _stamp(line)
            current = {}
            if "for group" in line:  # an empty assignment has no table
                assignments.append({"t": at, "partitions": {}})
                current = None
    return {
        "joins": joins,
        "revokes": revokes,
        "group": group,
        "assignments": assignments,
        "incidents": incidents,
    }


class OffsetWatch:
    """The consumer group's committed offsets, read without joining it (no subscribe)."""

    def __init__(self, bootstrap: str, group: str, ends: dict[str, dict[int, int]]) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from bus.config import consumer_config

        self._consumer = Consumer(consumer_config(bootstrap, group, "trainmedic-bench-catchup-offsets"))
        self._tps = [TopicPartition(t, p) for t, parts in sorted(ends.items()) for p in sorted(parts)]
        self._ends = ends
        self.last: dict[str, dict[int, int]] = {}

    def at_end(self) -> bool:
        try:
            got = self._consumer.committed(self._tps, timeout=5)
        except Exception:  # confluent_kafka raises KafkaException: not answered this time, ask again
            return False
        self.last = defaultdict(dict)
        done = True
        for tp in got:
            off = tp.offset if tp.offset >= 0 else 0  # negative: nothing committed yet
            self.last[tp.topic][tp.partition] = off
            done = done and off >= self._ends[tp.topic][tp.partition]
        return done

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._consumer.close()


@dataclass
class Tick:
    t: float
    records: list[int]  # per worker: records consumed so far (per topic the agent that saw most)
    cpu: list[float | None]  # per worker
    broker_cpu: float | None
    machine: tuple[int, int]
    bench_cpu: float  # this process (scraping, /proc reads): it shares the cores with the workers


def _records(counts: dict[tuple[str, str], float], topics: Sequence[str]) -> dict[str, int]:
    """Records of each input topic one worker consumed: a topic read by several agents
    (sched.events) is one record per event, not one per agent."""
    out: dict[str, int] = {}
    for (_, topic), v in counts.items():
        if topic in topics:
            out[topic] = max(out.get(topic, 0), int(v))
    return out


def run_workers(
    n_workers: int,
    run_no: int,
    bootstrap: str,
    broker_pid: int | None,
    backlog: Backlog,
    root: Path,
    known_pairs: set[tuple[str, str]],
    ready_timeout_s: float,
    drain_timeout_s: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from schemas.ids import cluster_scoped

    names = metric_names()
    topics = sorted(t for t, n in backlog.produced.items() if n > 0)
    group_id = f"trainmedic-streams-catchup-{n_workers}-{run_no}"
    run_root = root / f"run{run_no}-w{n_workers}"
    shutil.rmtree(run_root, ignore_errors=True)
    run_root.mkdir(parents=True)
    cpu_b0 = cpu_s(broker_pid)
    mach0 = machine_jiffies()
    t_spawn = time.time()
    workers = [start_worker(bootstrap, group_id, i, run_root) for i in range(n_workers)]
    watch: OffsetWatch | None = None
    ticks: list[Tick] = []
    t_first: float | None = None
    t_counts: float | None = None
    t_committed: float | None = None
    cpu_at_ready: dict[int, float | None] = {}
    try:
        deadline = t_spawn + drain_timeout_s
        while True:
            time.sleep(SCRAPE_S)
            now = time.time()
            for w in workers:
                if w.proc.poll() is not None:
                    raise RuntimeError(
                        f"streams worker {w.index} of the {n_workers}-worker run exited ({w.proc.returncode}); "
                        f"its log ({w.log_path}) ends:\n{w.tail()}"
                    )
                if w.ready_at is None and READY_MARK in w.log_path.read_bytes():
                    w.ready_at = now
                    cpu_at_ready[w.index] = cpu_s(w.pid)
                    say(f"[catchup] {n_workers} worker(s): worker {w.index} Ready after {now - w.started_at:.1f} s")
                elif w.ready_at is None and now - w.started_at > ready_timeout_s:
                    raise RuntimeError(
                        f"streams worker {w.index} of the {n_workers}-worker run was not Ready within "
                        f"{ready_timeout_s:.0f} s; its log ({w.log_path}) ends:\n{w.tail()}"
                    )
                try:
                    got = scrape(w.port, names)
                    w.counts, w.published = got.events_in, got.published
                except OSError:
                    w.scrape_errors += 1  # not listening yet, or busy: keep the last counts
            ticks.append(
                Tick(
                    t=now,
                    records=[sum(_records(w.counts, topics).values()) for w in workers],
                    cpu=[cpu_s(w.pid) for w in workers],
                    broker_cpu=cpu_s(broker_pid),
                    machine=machine_jiffies(),
                    bench_cpu=time.process_time(),
                )
            )
            if t_first is None and any(ticks[-1].records):
                t_first = now
            summed, expected = _totals(workers, backlog.produced)
            known_pairs.update(summed)
            counts_ok = all(
                any(t == topic for _, t in known_pairs)
                and all(summed[(a, t)] >= backlog.produced[topic] for a, t in known_pairs if t == topic)
                for topic in topics
            ) and all(summed[(a, t)] >= expected[t] for a, t in known_pairs if t not in backlog.produced)
            if not counts_ok:
                t_counts = None  # a second hop can fall behind again (a timer's anomalies): not drained yet
            elif t_counts is None:
                t_counts = now
            if counts_ok:
                if watch is None:
                    group = next(
                        (g for w in workers if (g := parse_worker_log(w.log_path)["group"])),
                        cluster_scoped(group_id),
                    )
                    watch = OffsetWatch(bootstrap, group, backlog.end_offset)
                if watch.at_end():
                    t_committed = now
                    break
            if now > deadline:
                say(f"[catchup] {n_workers} worker(s): not drained after {drain_timeout_s:.0f} s; stopping")
                break
            if len(ticks) % 20 == 0:
                done = sum(ticks[-1].records)
                say(
                    f"[catchup] {n_workers} worker(s): {now - t_spawn:.0f} s, {done:,} of {backlog.total:,} records "
                    f"({', '.join(str(r) for r in ticks[-1].records)})"
                )
        t_end = time.time()
        cpu_end = {w.index: cpu_s(w.pid) for w in workers}
        rss_end = {w.index: rss_mb(w.pid) for w in workers}
        peak_end = {w.index: peak_rss_mb(w.pid) for w in workers}
        cpu_b1 = cpu_s(broker_pid)
        mach1 = machine_jiffies()
        time.sleep(1.0)  # late counts: a record re-read after a rebalance shows here
        for w in workers:
            with contextlib.suppress(OSError):
                got = scrape(w.port, names)
                w.counts, w.published = got.events_in, got.published
    finally:
        if watch is not None:
            watch.close()
        for w in workers:
            stop_worker(w)
    return summarize_run(
        n_workers=n_workers,
        group_id=group_id,
        backlog=backlog,
        topics=topics,
        workers=workers,
        ticks=ticks,
        t_spawn=t_spawn,
        t_first=t_first,
        t_counts=t_counts,
        t_committed=t_committed,
        t_end=t_end,
        cpu_at_ready=cpu_at_ready,
        cpu_end=cpu_end,
        rss_end=rss_end,
        peak_end=peak_end,
        broker=(cpu_b0, cpu_b1, rss_mb(broker_pid), peak_rss_mb(broker_pid)),
        mach=(mach0, mach1),
        watch_last=watch.last if watch is not None else {},
    )


def _totals(workers: Sequence[Worker], produced: dict[str, int]) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """Events in per (agent, topic) summed over the workers, and what each consumed topic should
    reach: ours what we produced, a topic the workers write themselves (a repartition step, the
    detectors' anomalies) what they published to it."""
    summed: Counter[tuple[str, str]] = Counter()
    published: Counter[str] = Counter()
    for w in workers:
        for pair, v in w.counts.items():
            summed[pair] += int(v)
        for topic, v in w.published.items():
            published[topic] += int(v)
    expected: Counter[str] = Counter({t: n for t, n in published.items() if t not in produced})
    expected.update(produced)
    return summed, expected


def _tick_at(ticks: Sequence[Tick], t: float | None) -> Tick | None:
    """The last tick at or before t."""
    if t is None or not ticks:
        return None
    before = [k for k in ticks if k.t <= t]
    return before[-1] if before else ticks[0]


def _r(v: float | None, digits: int = 2) -> float | None:
    return None if v is None else round(v, digits)


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarize_run(
    *,
    n_workers: int,
    group_id: str,
    backlog: Backlog,
    topics: Sequence[str],
    workers: Sequence[Worker],
    ticks: Sequence[Tick],
    t_spawn: float,
    t_first: float | None,
    t_counts: float | None,
    t_committed: float | None,
    t_end: float,
    cpu_at_ready: dict[int, float | None],
    cpu_end: dict[int, float | None],
    rss_end: dict[int, float | None],
    peak_end: dict[int, float | None],
    broker: tuple[float | None, float | None, float | None, float | None],
    mach: tuple[tuple[int, int], tuple[int, int]],
    watch_last: dict[str, dict[int, int]],
) -> dict[str, Any]:
    summed, expected = _totals(workers, backlog.produced)
    by_agent = {f"{a} / {t}": n for (a, t), n in sorted(summed.items())}
    duplicates = {f"{a} / {t}": n - expected[t] for (a, t), n in sorted(summed.items()) if t in expected}
    # Topics the workers wrote and read themselves (a repartition step): how much the second hop carried.
    derived = {
        t: {
            "published": expected[t],
            "consumed": {a: n for (a, tt), n in sorted(summed.items()) if tt == t},
        }
        for t in sorted(expected)
        if t not in backlog.produced and any(tt == t for _, tt in summed)
    }
    dup_total = sum(max(0, v) for v in duplicates.values())
    drained = t_committed is not None
    # Exact counters (no duplicates): the counters' time. Otherwise they may have reached the total
    # early, and the commit time (at most one commit interval late) is the honest figure.
    t_drained = t_counts if drained and dup_total == 0 else t_committed
    window = _sub(t_drained, t_first)
    start_tick, end_tick = _tick_at(ticks, t_first), _tick_at(ticks, t_drained)
    rows = []
    for w in workers:
        log = parse_worker_log(w.log_path)
        final = log["assignments"][-1]["partitions"] if log["assignments"] else {}
        recs = _records(w.counts, topics)
        of_final = sum(backlog.by_partition.get(t, {}).get(p, 0) for t in topics for p in final.get(t, []))
        c_first = start_tick.cpu[w.index] if start_tick else None
        c_drained = end_tick.cpu[w.index] if end_tick else None
        drain_cpu = _sub(c_drained, c_first)
        rows.append(
            {
                "index": w.index,
                "pid": w.pid,
                "ready_s": _r(_sub(w.ready_at, w.started_at)),
                "group_joins": len(log["joins"]),
                "revocations": log["revokes"],
                "incidents": dict(log["incidents"]),
                "last_assignment_s": _r(_sub(log["assignments"][-1]["t"], w.started_at))
                if log["assignments"]
                else None,
                "assignments": len(log["assignments"]),
                "partitions": {t: final.get(t, []) for t in topics},
                "records": recs,
                "records_total": sum(recs.values()),
                "records_of_final_partitions": of_final,
                "share_pct": _r(100 * sum(recs.values()) / max(1, sum(summed_records(workers, topics).values())), 1),
                "events_per_s": _r(sum(recs.values()) / window, 0) if window else None,
                "cpu_s": {
                    "start_to_ready": _r(cpu_at_ready.get(w.index)),
                    "drain": _r(drain_cpu),
                    "total": _r(cpu_end.get(w.index)),
                },
                "cpu_pct_of_core_during_drain": _r(100 * drain_cpu / window, 1) if window and drain_cpu else None,
                "rss_mb": _r(rss_end.get(w.index), 1),
                "peak_rss_mb": _r(peak_end.get(w.index), 1),
                "scrape_errors": w.scrape_errors,
                "log": str(w.log_path),
            }
        )
    b0, b1, b_rss, b_peak = broker
    b_first = start_tick.broker_cpu if start_tick else None
    b_drained = end_tick.broker_cpu if end_tick else None
    b_drain = _sub(b_drained, b_first)
    (m0b, m0t), (m1b, m1t) = (
        (start_tick.machine if start_tick else mach[0]),
        (end_tick.machine if end_tick else mach[1]),
    )
    bench_cpu = end_tick.bench_cpu - start_tick.bench_cpu if start_tick and end_tick else None
    ours: list[float | None] = [x["cpu_s"]["drain"] for x in rows] + [b_drain, bench_cpu]
    known = [v for v in ours if v is not None]
    # CPU the rest of the machine took meanwhile (other processes on the same cores): it slows the run.
    other_cpu = (m1b - m0b) / CLK_TCK - sum(known) if len(known) == len(ours) else None
    readies = [w.ready_at for w in workers if w.ready_at is not None]
    incidents: Counter[str] = Counter()
    for row in rows:
        incidents.update(row["incidents"])
    return {
        "workers": n_workers,
        "group": group_id,
        "drained": drained,
        "drain_s": _r(_sub(t_drained, t_spawn)),
        "drain_from_first_record_s": _r(window),
        "drain_from_last_ready_s": _r(_sub(t_drained, max(readies))) if readies and len(readies) == n_workers else None,
        "first_record_s": _r(_sub(t_first, t_spawn)),
        "counters_reached_s": _r(_sub(t_counts, t_spawn)),
        "offsets_committed_s": _r(_sub(t_committed, t_spawn)),
        "run_s": _r(t_end - t_spawn),
        "events_per_s": _r(backlog.total / window, 0) if window else None,
        "duplicates": dup_total,
        "duplicates_by_agent": {k: v for k, v in duplicates.items() if v},
        "events_in_by_agent": by_agent,
        "derived_topics": derived,
        "incidents": dict(incidents),  # on a healthy fleet: each one is a false alarm (or a catch-up artefact)
        "committed": {t: dict(p) for t, p in watch_last.items()},
        "per_worker": rows,
        "broker": {
            "cpu_s_drain": _r(b_drain),
            "cpu_s_run": _r(_sub(b1, b0)),
            "cpu_pct_of_core_during_drain": _r(100 * b_drain / window, 1) if window and b_drain else None,
            "rss_mb": _r(b_rss, 1),
            "peak_rss_mb": _r(b_peak, 1),
        },
        "bench_cpu_s_drain": _r(bench_cpu),
        "other_processes_cpu_s_drain": _r(max(0.0, other_cpu), 1) if other_cpu is not None else None,
        "machine_busy_pct_during_drain": _r(100 * (m1b - m0b) / (m1t - m0t), 1) if m1t > m0t else None,
        "series": [[round(k.t - t_spawn, 2), *k.records] for k in ticks],
    }


def summed_records(workers: Sequence[Worker], topics: Sequence[str]) -> Counter[str]:
    total: Counter[str] = Counter()
    for w in workers:
        total.update(_records(w.counts, topics))
    return total


# --- the benchmark -------------------------------------------------------------------------------------


@dataclass
class Options:
    quick: bool = False
    nodes: int = 5000
    minutes: float = 2.0
    workers: list[int] = field(default_factory=lambda: [1, 2])
    seed: int = 7
    out: Path = RESULTS
    prefix: str = "catchup"
    data_dir: Path = REPO / "var" / "bench" / "catchup"
    ready_timeout_s: float = 120.0
    drain_timeout_s: float = 1800.0
    say: Callable[[str], None] = print


def run_bench(o: Options) -> dict[str, Any]:
    from bus.admin import ensure_topics
    from schemas.topics import DEFAULT_PARTITIONS
    from trainmedic.settings import Settings
    from trainmedic.stack.broker import EmbeddedBroker

    o.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(o.data_dir, ignore_errors=True)
    o.data_dir.mkdir(parents=True)
    seconds = o.minutes * 60
    doc: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.catchup " + " ".join(sys.argv[1:]),
        "quick": o.quick,
        "config": {
            "nodes": o.nodes,
            "gpus": o.nodes * 8,
            "event_seconds": seconds,
            "workers": o.workers,
            "seed": o.seed,
            "partitions": DEFAULT_PARTITIONS,
            "job_nodes": JOB_NODES,
        },
    }
    broker = EmbeddedBroker(log_path=o.data_dir / "broker.log").start()
    try:
        # As `trainmedic topics create` does: the project's partitions and retention.
        retention = Settings.load().topic_retention_hours
        ensure_topics(broker.bootstrap, DEFAULT_PARTITIONS, retention_hours=retention)
        rss0 = rss_mb(broker.pid)
        o.say(
            f"[catchup] preloading {seconds:.0f} s of events of {o.nodes} nodes x 8 GPUs ({DEFAULT_PARTITIONS} partitions)"
        )
        cpu_b0 = cpu_s(broker.pid)
        backlog = preload(broker.bootstrap, o.nodes, seconds, o.seed, o.say)
        doc["preload"] = {
            "produced": backlog.produced,
            "total": backlog.total,
            "by_partition": {t: {str(p): n for p, n in ps.items()} for t, ps in backlog.by_partition.items()},
            "dropped": backlog.dropped,
            "offsets_consistent": backlog.offsets_consistent,
            "jobs": backlog.jobs,
            "generate_s": backlog.gen_s,
            "publish_s": backlog.publish_s,
            "records_per_s": round(backlog.total / max(backlog.publish_s, 1e-6)),
            "bench_cpu_s": backlog.main_cpu_s,
            "broker_cpu_s": _r(_sub(cpu_s(broker.pid), cpu_b0)),
            "broker_rss_mb_before": _r(rss0, 1),
            "broker_rss_mb_after": _r(rss_mb(broker.pid), 1),
            "broker_peak_rss_mb": _r(peak_rss_mb(broker.pid), 1),
        }
        p = doc["preload"]
        o.say(
            f"[catchup] preloaded {backlog.total:,} records in {backlog.publish_s:.1f} s "
            f"({', '.join(f'{t} {n:,}' for t, n in backlog.produced.items())}); {backlog.jobs} jobs; "
            f"dropped {sum(backlog.dropped.values())}; broker RSS {p['broker_rss_mb_after']} MB "
            f"(peak {p['broker_peak_rss_mb']} MB)"
        )
        if backlog.dropped:
            raise RuntimeError(f"records dropped while preloading: {backlog.dropped}")
        runs: list[dict[str, Any]] = []
        known: set[tuple[str, str]] = set()
        for run_no, w in enumerate(o.workers, start=1):
            o.say(f"[catchup] run {run_no}: {w} worker(s) drain {backlog.total:,} records")
            if not broker.alive():
                raise RuntimeError(f"the broker died ({broker.exit_status()}); see {o.data_dir / 'broker.log'}")
            if run_no > 1:
                gone = reset_other_topics(broker.bootstrap, set(backlog.produced), DEFAULT_PARTITIONS, retention)
                o.say(f"[catchup] deleted and re-made the {len(gone)} topics the last run's workers wrote or made")
            try:
                r = run_workers(
                    w,
                    run_no,
                    broker.bootstrap,
                    broker.pid,
                    backlog,
                    o.data_dir,
                    known,
                    o.ready_timeout_s,
                    o.drain_timeout_s,
                    o.say,
                )
            except RuntimeError as exc:
                # One failed run (a worker that died or never got Ready) is a result too: the
                # other runs go on, and the report says what happened.
                o.say(f"[catchup] run {run_no} ({w} worker(s)) FAILED: {exc}")
                runs.append({"workers": w, "drained": False, "error": str(exc)[-6000:]})
                continue
            runs.append(r)
            o.say("[catchup] " + _oneline(r))
        doc["runs"] = runs
        doc["broker_peak_rss_mb"] = _r(peak_rss_mb(broker.pid), 1)
    finally:
        broker.stop()
    doc["not_measured"] = NOT_MEASURED
    json_path = o.out / f"{o.prefix}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md_path = o.out / f"{o.prefix}.md"
    md_path.write_text(markdown(doc))
    common = results.record(
        "catchup",
        figures.catchup(doc),
        root=o.out,
        started=doc["measured_at"],
        machine=doc["machine"],
        details=doc,
        variant=results.variant_name(o.prefix, "catchup"),
        report=md_path,
    )
    o.say(table(doc))
    o.say(f"[catchup] wrote {json_path}, {md_path} and {common}")
    return doc


NOT_MEASURED = [
    "Records per partition per worker: the events-in counter has agent and topic labels, not partitions; "
    "each worker's partitions come from its log's last assignment table, its records per topic from the counter.",
    "Consumer lag from the broker: the embedded broker's end offsets are wrong; the drain is judged by the "
    "counters and the group's committed offsets against the offsets our producer was acknowledged.",
    "Whether the workers' output is right: the fleet is healthy, so only the incidents they published (from their "
    "logs) are counted; nothing else is judged.",
]


def _oneline(r: dict[str, Any]) -> str:
    per = ", ".join(f"w{x['index']} {x['events_per_s']}/s" for x in r["per_worker"])
    return (
        f"{r['workers']} worker(s): drained={r['drained']} in {r['drain_s']} s from start "
        f"({r['drain_from_first_record_s']} s from the first record), {r['events_per_s']} events/s ({per}), "
        f"duplicates {r['duplicates']}, broker CPU {r['broker']['cpu_s_drain']} s"
    )


def _fmt_parts(parts: dict[str, list[int]]) -> str:
    """Partitions per topic, grouped when topics share them: 'gpu.samples, job.logs: 0,1'."""
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for t, ps in parts.items():
        groups[tuple(ps)].append(t)
    if len(groups) == 1:
        only = next(iter(groups))
        return "all input topics: " + (",".join(map(str, only)) or "none")
    return "; ".join(f"{', '.join(ts)}: {','.join(map(str, ps)) or 'none'}" for ps, ts in groups.items())


def table(doc: dict[str, Any]) -> str:
    from bench.report import _f

    head = (
        f"{'workers':>7} {'drain s':>8} {'from 1st rec':>12} {'events/s':>9} {'per worker events/s':>22} "
        f"{'worker CPU s':>16} {'broker CPU s':>12} {'ready s':>12} {'dups':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in doc["runs"]:
        if "error" in r:
            lines.append(f"{r['workers']:>7} FAILED: {r['error'].splitlines()[0][:150]}")
            continue
        pw = r["per_worker"]
        lines.append(
            f"{r['workers']:>7} {_f(r['drain_s']):>8} {_f(r['drain_from_first_record_s']):>12} "
            f"{_f(r['events_per_s']):>9} {' '.join(_f(x['events_per_s']) for x in pw):>22} "
            f"{' '.join(_f(x['cpu_s']['drain']) for x in pw):>16} {_f(r['broker']['cpu_s_drain']):>12} "
            f"{' '.join(_f(x['ready_s']) for x in pw):>12} {r['duplicates']:>6}"
        )
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    from bench.report import _f, _row

    m, c, p = doc["machine"], doc["config"], doc["preload"]
    md = [
        "# Catch-up benchmark: streams workers draining a backlog\n",
        f"Measured {doc['measured_at']} on {m['cores']} cores ({m['cpu']}), {m.get('mem_gb')} GB, Python "
        f"{m['python']}, with `{doc['command'].strip()}`. One run per worker count, not an average.\n",
        f"Backlog: {c['nodes']:,} nodes x 8 GPUs ({c['gpus']:,} GPUs), {p['jobs']} jobs of {c['job_nodes']} nodes, "
        f"{c['event_seconds']:.0f} s of events from `sim.cluster` (one GpuSample per node per second, one "
        "ProgressBatch and LogBatch per job per step, every job's RUNNING first), all published through "
        "`bus.publish.Publisher` to the embedded Tansu broker before any worker starts, on topics of "
        f"{c['partitions']} partitions made by `bus.admin.ensure_topics`. Each run starts its workers as "
        "`trainmedic up` does (`python -m trainmedic.stack.streams_worker worker --without-web -l info`) in a consumer "
        "group of their own, so every run drains the same backlog from the beginning (between runs every other "
        "topic is deleted and made again, empty). Drained: every agent's events-in counter (summed over workers) "
        "reached what was produced on its topic, every agent reading a topic the workers write themselves read "
        "what they published to it, and the group's committed offsets reached the end the producer was "
        "acknowledged (the broker's own end offsets are wrong and never used).\n",
        "## Backlog\n",
        "| topic | records | per partition |",
        "|---|---|---|",
    ]
    for t, n in p["produced"].items():
        parts = p["by_partition"].get(t, {})
        md.append(
            _row([t, f"{n:,}", ", ".join(f"p{k} {v:,}" for k, v in sorted(parts.items(), key=lambda kv: int(kv[0])))])
        )
    md.append(_row(["**total**", f"{p['total']:,}", ""]))
    md.append("")
    md.append(
        f"Published in {p['publish_s']} s ({p['records_per_s']:,} records/s; simulation {p['generate_s']} s, "
        f"{p['bench_cpu_s']} CPU s in the benchmark, {p['broker_cpu_s']} CPU s in the broker); dropped "
        f"{sum(p['dropped'].values())}; acknowledged offsets consistent with the counts: {p['offsets_consistent']}. "
        f"Broker RSS {p['broker_rss_mb_before']} MB before, {p['broker_rss_mb_after']} MB after the preload, "
        f"peak {doc.get('broker_peak_rss_mb')} MB over the whole benchmark (memory-only storage).\n"
    )
    md += [
        "## Drain\n",
        "| workers | drained | drain s (from start) | from first record | from last Ready | events/s | speed-up "
        "| events/s per worker | worker CPU s (drain) | broker CPU s (drain) | broker CPU % | machine busy % "
        "| other processes' CPU s | duplicates |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r.get("events_per_s") for r in doc["runs"] if r["workers"] == 1), None)
    for r in doc["runs"]:
        if "error" in r:
            md.append(_row([r["workers"], "FAILED: " + r["error"].splitlines()[0][:300], *[""] * 12]))
            continue
        pw = r["per_worker"]
        md.append(
            _row(
                [
                    r["workers"],
                    "yes" if r["drained"] else "NO",
                    _f(r["drain_s"]),
                    _f(r["drain_from_first_record_s"]),
                    _f(r["drain_from_last_ready_s"]),
                    _f(r["events_per_s"]),
                    f"{r['events_per_s'] / base:.2f}x" if base and r["events_per_s"] else "-",
                    " / ".join(_f(x["events_per_s"]) for x in pw),
                    " / ".join(_f(x["cpu_s"]["drain"]) for x in pw),
                    _f(r["broker"]["cpu_s_drain"]),
                    _f(r["broker"]["cpu_pct_of_core_during_drain"]),
                    _f(r["machine_busy_pct_during_drain"]),
                    _f(r.get("other_processes_cpu_s_drain")),
                    r["duplicates"],
                ]
            )
        )
    md += [
        "",
        "events/s: records of all input topics / (drained - first record consumed). CPU: utime + stime from "
        "/proc over the same window. Machine busy: of all cores. Other processes: what the rest of the machine "
        "used of the cores meanwhile (not this benchmark's; figures taken while it is high are slowed by it). The "
        "benchmark's own process (scraping every 0.5 s) used "
        + ", ".join(
            f"{_f(r.get('bench_cpu_s_drain'))} CPU s ({r['workers']} w)" for r in doc["runs"] if "error" not in r
        )
        + ".\n",
        "## Per worker: start-up, rebalance, partitions\n",
        "| workers | worker | start -> Ready s | group joins | last assignment at s | partitions (final) "
        "| records | of its final partitions | share | events/s | CPU s start->Ready / drain / total | CPU % (drain) "
        "| RSS MB (peak) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        for x in r.get("per_worker", []):
            cs = x["cpu_s"]
            md.append(
                _row(
                    [
                        r["workers"],
                        x["index"],
                        _f(x["ready_s"]),
                        x["group_joins"],
                        _f(x["last_assignment_s"]),
                        _fmt_parts(x["partitions"]),
                        f"{x['records_total']:,}",
                        f"{x['records_of_final_partitions']:,}",
                        f"{_f(x['share_pct'])} %",
                        _f(x["events_per_s"]),
                        f"{_f(cs['start_to_ready'])} / {_f(cs['drain'])} / {_f(cs['total'])}",
                        _f(x["cpu_pct_of_core_during_drain"]),
                        f"{_f(x['rss_mb'])} ({_f(x['peak_rss_mb'])})",
                    ]
                )
            )
    md += [
        "",
        "records: what the worker consumed (per topic, the agent that counted most: sched.events is read by several "
        "agents); 'of its final partitions': what was produced on the partitions its last assignment gave it. "
        "They differ when partitions moved during the drain (a worker that joined late took them over).\n",
    ]
    hops = [(r["workers"], t, d) for r in doc["runs"] for t, d in r.get("derived_topics", {}).items()]
    if hops:
        md.append("## Topics the workers wrote and read themselves\n")
        md.append(
            "A repartition step (or the detectors' anomalies) is a second hop inside the streams app; the drain "
            "waits for it too.\n"
        )
        md += ["| workers | topic | published by the workers | consumed (agent: records) |", "|---|---|---|---|"]
        for w, t, d in hops:
            md.append(_row([w, t, f"{d['published']:,}", ", ".join(f"{a}: {n:,}" for a, n in d["consumed"].items())]))
        md.append("")
    # Always said, also when none: a catch-up that calls healthy jobs hung is a wrong action waiting.
    md.append("## Incidents on a healthy fleet\n")
    md.append(
        "The backlog holds no fault: every incident the workers published while draining it is a false alarm "
        "of the catch-up (their worker logs name job and culprit).\n"
    )
    for r in doc["runs"]:
        found = r.get("incidents") or {}
        md.append(
            f"- {r['workers']} worker(s): "
            + (", ".join(f"{c} {n}" for c, n in sorted(found.items())) if found else "none")
        )
    md.append("")
    dups = [r for r in doc["runs"] if r.get("duplicates")]
    if dups:
        md.append("## Records counted twice\n")
        for r in dups:
            md.append(
                f"- {r['workers']} worker(s): {r['duplicates']:,} "
                f"({', '.join(f'{k} +{v:,}' for k, v in r['duplicates_by_agent'].items() if v > 0)}): re-read "
                "after a rebalance from the group's last commit (at-least-once). The drain time of this run is the "
                f"commit time ({_f(r['offsets_committed_s'])} s), not the counters' ({_f(r['counters_reached_s'])} s).\n"
            )
    md.append("## Not measured\n")
    md += [f"- {x}" for x in doc["not_measured"]]
    md.append("")
    return "\n".join(md)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.catchup", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="200 nodes, 20 s of events, workers 1,2 (the smoke test)")
    p.add_argument("--nodes", type=int, default=None, help="fleet size (default 5000; --quick 200)")
    p.add_argument("--minutes", type=float, default=None, help="minutes of events in the backlog (default 2)")
    p.add_argument("--workers", default=None, help="comma-separated worker counts, one run each (default 1,2)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--prefix", default="catchup", help="output file names: PREFIX.json, PREFIX.md")
    p.add_argument("--data-dir", type=Path, default=REPO / "var" / "bench" / "catchup")
    p.add_argument("--drain-timeout", type=float, default=1800.0, help="give a run up this many seconds")
    return p.parse_args(argv)


def options_from_args(a: argparse.Namespace) -> Options:
    workers = [int(x) for x in (a.workers or "1,2").split(",") if x.strip()]
    if not workers or any(w < 1 for w in workers):
        raise SystemExit("--workers: one or more counts >= 1, e.g. 1,2,4")
    return Options(
        quick=a.quick,
        nodes=a.nodes if a.nodes is not None else (200 if a.quick else 5000),
        minutes=a.minutes if a.minutes is not None else (20 / 60 if a.quick else 2.0),
        workers=workers,
        seed=a.seed,
        out=a.out,
        prefix=a.prefix,
        data_dir=a.data_dir,
        drain_timeout_s=a.drain_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    doc = run_bench(options_from_args(parse_args(argv)))
    return 0 if all(r.get("drained") for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
