"""End-to-end pipeline benchmark (not a test): the real stack against a simulated cluster.

Each scenario starts the real Stack (embedded Tansu broker, Faust streams worker subprocess,
executor and chDB audit sink) with the simulated scheduler from sim.cluster as the executor's
backend, runs an N-node x 8-GPU cluster (GPU samples at 1 Hz per node, progress lines, kernel
lines, scheduler events), injects faults from sim.faults with ground truth and measures from the
audit trail:

- detection latency: first fault signal written -> incident published;
- action latency: incident -> effect verified (the audit's action_latency_s);
- end to end: fault -> job RUNNING again (recovering actions) or stopped (stop);
- category, culprit and action accuracy; incidents and actions on healthy jobs;
- throughput (input events/s, log lines/s) and consumer lag, measured with probes: every
  second one deliberately undecodable record per partition of gpu.samples, job.logs and
  node.kernel; the agent that reads it dead-letters it when it gets to it, so
  (dead letter time - probe publish time) is that agent's lag on that partition (the
  embedded broker's end offsets are wrong, see docs/environment.md);
- CPU (% of one core) and RSS of the broker, the streams worker and this process (simulator,
  audit sink and executor threads broken out from /proc/self/task).

The status quo (no trainmedic) is modelled for the same injected faults (see `baseline`).

Run: .venv/bin/python -m bench.pipeline [--quick] [--nodes 128] [--reps 2] [--scale 64,128,...]
Writes bench/results/pipeline.json, pipeline.md and pipeline_*.png (see --out), and the result in the common
format, bench/results/pipeline/<date>-<commit>[-<prefix>].json (bench/results.py).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench import figures, results
from bench.machine import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
PROBE_TOPICS = ("gpu.samples", "job.logs", "node.kernel")
AGENT_OF_TOPIC = {"gpu.samples": "detect_gpu", "job.logs": "detect_logs", "node.kernel": "detect_kernel"}
LAG_BOUND_S = 2.0

log = logging.getLogger("trainmedic.bench")

# The bench acts autonomously, and lifts the guardrails that would (correctly) stop a real
# deployment from draining dozens of nodes in an hour: the benchmark injects that many faults.
BENCH_POLICY = """\
version: 1
mode: autonomous
categories: {}
partitions: {}
actions:
  gpu_hardware: drain_and_requeue
  node: drain_and_requeue
  interconnect: requeue
  hang: requeue
  user_code: stop
  oom: stop
  numerical: stop
  storage: stop
  healthy: none
min_confidence: 0.6
guardrails:
  kill_switch: false
  autonomy_partitions: null
  max_drains_per_window: 10000
  drain_window_s: 3600
  max_drain_fraction: 0.5
  node_cooldown_s: 0
"""


# --- configuration --------------------------------------------------------------------------------


@dataclass
class ScenarioConfig:
    name: str = "main"
    nodes: int = 128
    seed: int = 7
    kinds: list[str] = field(default_factory=list)  # empty: no faults
    reps: int = 1
    transport: str = "direct"
    payload: str = "fast"
    job_sizes: list[list[float]] = field(default_factory=lambda: [[2, 0.45], [3, 0.25], [4, 0.30]])
    min_duration_s: float = 0.0  # run at least this long (from the simulator's start)
    first_step_extra_s: list[float] = field(default_factory=lambda: [12.0, 25.0])
    start_s: float = 25.0
    spacing_s: float = 4.0
    hang_at_s: float | None = None
    straggler_at_s: float = 200.0
    nccl_timeout_s: float = 600.0  # NCCL's default watchdog; --quick compresses it to show the cascade
    requeue_delay_s: float = 1.0
    backdate_s: float = 0.0
    probe_interval_s: float = 1.0
    steady_after_s: float = 10.0  # lag and CPU are taken after this warm-up
    data_dir: str = str(REPO / "var" / "bench")
    profile_s: float = 0.0  # py-spy the streams worker for this long (0: no)
    profile_at_s: float = 20.0
    settle_s: float = 1.0
    collateral_wait_s: float = 5.0
    gpu_summary_every_s: float | None = None  # edge aggregation in the node producers (None: off)
    healthy_min: int = 3
    workers: int = 1  # streams workers (one consumer group)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScenarioConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# Time a fault of each kind gets to be detected and acted on before the scenario gives up on it.
def resolve_budget_s(kind: str, cfg: ScenarioConfig) -> float:
    if kind == "straggler":
        return 200.0
    if kind == "hang":
        return 100.0
    # Explicit faults resolve in seconds; a compressed watchdog's collateral-only incident needs it too.
    return 60.0 + (cfg.nccl_timeout_s if cfg.nccl_timeout_s < 60 else 0.0)


# --- /proc sampling ---------------------------------------------------------------------------------


def _cpu_s(stat_path: str) -> float | None:
    try:
        raw = Path(stat_path).read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def _rss_mb(pid: int) -> float | None:
    try:
        statm = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    return int(statm[1]) * PAGE / 1e6


def _children() -> dict[str, int]:
    """The broker and streams worker started by this process (by their command lines)."""
    me = os.getpid()
    found: dict[str, int] = {}
    workers: list[int] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid != me:
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if "tansu" in cmd:
            found["broker"] = int(d.name)
        elif "streams_worker" in cmd or "streams.app" in cmd:
            workers.append(int(d.name))
    # Several streams workers (--workers): "worker" is the first, "worker-1" ... the others.
    for i, pid in enumerate(sorted(workers)):
        found["worker" if i == 0 else f"worker-{i}"] = pid
    return found


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(x) for x in parts[:8]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


class ProcSampler:
    """CPU seconds and RSS of the broker, the streams worker and this process (with its
    threads by name), once a second."""

    THREADS = ("audit-sink", "executor", "sim-cluster", "sim-tailers", "bench-prober")

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self.pids = _children()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def start(self) -> ProcSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t": time.time(), "cpu": {}, "rss_mb": {}}
        me = os.getpid()
        for name, pid in (("main", me), *self.pids.items()):
            row["cpu"][name] = _cpu_s(f"/proc/{pid}/stat")
            row["rss_mb"][name] = _rss_mb(pid)
        tids = {t.name: t.native_id for t in threading.enumerate() if t.name in self.THREADS and t.native_id}
        for name, tid in tids.items():
            row["cpu"][f"main/{name}"] = _cpu_s(f"/proc/{me}/task/{tid}/stat")
        busy, total = _machine_busy()
        row["machine"] = [busy / CLK_TCK, total / CLK_TCK]
        return row

    def _run(self) -> None:
        while True:
            self.rows.append(self.sample())
            if self._stop.wait(self.interval_s):
                self.rows.append(self.sample())
                return


def cpu_summary(rows: list[dict[str, Any]], t_from: float, t_to: float) -> dict[str, Any]:
    """% of one core per component over [t_from, t_to], and peak RSS."""
    window = [r for r in rows if t_from <= r["t"] <= t_to]
    if len(window) < 2:
        window = rows[-2:] if len(rows) >= 2 else rows
    out: dict[str, Any] = {"window_s": 0.0, "cpu_pct": {}, "rss_mb_peak": {}, "machine_busy_pct": None}
    if len(window) < 2:
        return out
    a, b = window[0], window[-1]
    span = b["t"] - a["t"]
    out["window_s"] = round(span, 1)
    for name in b["cpu"]:
        if a["cpu"].get(name) is not None and b["cpu"].get(name) is not None:
            out["cpu_pct"][name] = round(100 * (b["cpu"][name] - a["cpu"][name]) / span, 1)
    named = sum(v for k, v in out["cpu_pct"].items() if k.startswith("main/"))
    if "main" in out["cpu_pct"]:
        out["cpu_pct"]["main/other (chDB, librdkafka, gc)"] = round(out["cpu_pct"]["main"] - named, 1)
    for name in b["rss_mb"]:
        vals = [r["rss_mb"].get(name) for r in rows if r["rss_mb"].get(name) is not None]
        if vals:
            out["rss_mb_peak"][name] = round(max(vals), 1)
    db, dt_ = b["machine"][0] - a["machine"][0], b["machine"][1] - a["machine"][1]
    out["machine_busy_pct"] = round(100 * db / dt_, 1) if dt_ > 0 else None
    if dt_ > 0:
        # CPU the rest of the machine used meanwhile (other processes), in % of one core.
        cores = os.cpu_count() or 1
        ours = sum(v or 0.0 for k, v in out["cpu_pct"].items() if k in ("main", "broker") or _is_worker(k))
        out["cpu_pct"]["other processes"] = round(max(0.0, 100 * cores * db / dt_ - ours), 1)
    workers = [v for k, v in out["cpu_pct"].items() if _is_worker(k)]
    if workers:
        out["cpu_pct"]["workers"] = round(sum(workers), 1)
    # The central pipeline: streams workers + broker + the sinks (audit sink and executor threads).
    central = [out["cpu_pct"].get(k) for k in ("broker", "main/audit-sink", "main/executor")]
    if workers and all(v is not None for v in central):
        out["central_cpu_pct"] = round(sum(workers) + sum(v or 0.0 for v in central), 1)
    return out


def _is_worker(name: str) -> bool:
    return name == "worker" or name.startswith("worker-")


# --- lag probes -----------------------------------------------------------------------------------------


class Prober:
    """One undecodable record per partition of each probed topic, every interval."""

    def __init__(self, bootstrap: str, interval_s: float, partitions: int) -> None:
        from confluent_kafka import Producer

        from bus.config import producer_config

        self._producer = Producer(producer_config(bootstrap, "bench-prober"))
        self.interval_s = interval_s
        self.partitions = partitions
        self.sent: list[tuple[str, int, int, float]] = []  # topic, partition, seq, sent_at
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-prober", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._producer.flush(10)

    def send_round(self) -> int:
        from schemas.events import SCHEMA_VERSION

        self._seq += 1
        for topic in PROBE_TOPICS:
            for p in range(self.partitions):
                now = time.time()
                payload = orjson.dumps({"schema_version": SCHEMA_VERSION, "bench_probe": self._seq, "sent_at": now})
                self._producer.produce(topic, value=payload, key=b"bench-probe", partition=p)
                self.sent.append((topic, p, self._seq, now))
        self._producer.poll(0)
        return self._seq

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.send_round()


# --- the scenario ---------------------------------------------------------------------------------------


def _secs(col: str) -> str:
    return f"toUnixTimestamp64Milli({col}) / 1000.0"


def _query_audit(store: Any) -> dict[str, list[dict[str, Any]]]:
    q = store.query
    return {
        "incidents": q(
            f"SELECT incident_id, {_secs('event_time')} AS t, {_secs('first_signal_time')} AS first_signal, job_id, "
            "category, culprit_node, culprit_rank, confidence, explanation, detection_latency_s, "
            "length(anomaly_ids) AS n_anomalies "
            "FROM {db}.incidents FINAL ORDER BY t"
        ),
        "decisions": q(
            f"SELECT decision_id, incident_id, {_secs('event_time')} AS t, job_id, category, culprit_node, action, "
            "mode, kind, rule, reason FROM {db}.decisions FINAL ORDER BY t"
        ),
        "results": q(
            f"SELECT action_id, incident_id, {_secs('event_time')} AS t, job_id, node, action, status, steps, error, "
            "action_latency_s FROM {db}.action_results FINAL ORDER BY t"
        ),
        "anomalies": q(
            f"SELECT detector, source, signature, category, role, job_id, node, {_secs('event_time')} AS t, "
            f"{_secs('produced_at')} AS produced FROM {{db}}.anomalies FINAL ORDER BY t"
        ),
        "dead_letters": q(
            f"SELECT original_topic AS topic, original_partition AS partition, {_secs('event_time')} AS t, "
            "payload_b64 FROM {db}.dead_letters FINAL"
        ),
    }


def _probe_results(dead: list[dict[str, Any]], sent: list[tuple[str, int, int, float]]) -> list[dict[str, Any]]:
    seen: dict[tuple[str, int, int], float] = {}
    for d in dead:
        try:
            body = orjson.loads(base64.b64decode(d["payload_b64"]))
        except (ValueError, orjson.JSONDecodeError):
            continue
        if isinstance(body, dict) and "bench_probe" in body:
            seen[(d["topic"], int(d["partition"]), int(body["bench_probe"]))] = float(d["t"])
    out = []
    for topic, p, seq, sent_at in sent:
        t = seen.get((topic, p, seq))
        out.append(
            {
                "topic": topic,
                "partition": p,
                "seq": seq,
                "sent_at": sent_at,
                "lag_s": None if t is None else round(t - sent_at, 4),
            }
        )
    return out


def _wait_probes(store: Any, prober: Prober, seq: int, timeout_s: float) -> float | None:
    """Seconds until every probe of round `seq` was dead-lettered and audited (None: not in time)."""
    t0 = time.time()
    want = len(PROBE_TOPICS) * prober.partitions
    while time.time() - t0 < timeout_s:
        rows = store.query("SELECT payload_b64 FROM {db}.dead_letters FINAL")
        n = 0
        for r in rows:
            with contextlib.suppress(ValueError, orjson.JSONDecodeError):
                body = orjson.loads(base64.b64decode(r["payload_b64"]))
                if isinstance(body, dict) and body.get("bench_probe") == seq:
                    n += 1
        if n >= want:
            return time.time() - t0
        time.sleep(0.25)
    return None


def _profile(pid: int, seconds: float, out: Path) -> dict[str, Any]:
    """py-spy the streams worker; returns the top frames by own and by inclusive time."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return {"error": "py-spy is not installed (pip install py-spy)"}
    proc = subprocess.run(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds)),
            "--rate",
            "50",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=False,
    )
    if proc.returncode != 0 or not out.exists():
        return {"error": f"py-spy failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"}
    return summarize_profile(out.read_text(), seconds=seconds)


def _frame(f: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)': one entry per function, not per line."""
    name, _, where = f.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({short})"


def summarize_profile(raw: str, top: int = 20, seconds: float | None = None, rate: int = 50) -> dict[str, Any]:
    """Top functions by own and by inclusive share of the samples, and own time per file.

    py-spy records only threads that are running, so `active_pct` (samples over
    seconds x rate) is how busy the worker's Python threads were."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        n = int(count_s)
        frames = [_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        by_file[frames[-1].rsplit(" (", 1)[-1].rstrip(")")] += n
        for f in set(frames):
            incl[f] += n

    def pct(c: Counter[str]) -> list[dict[str, Any]]:
        return [{"frame": f, "pct": round(100 * n / total, 1)} for f, n in c.most_common(top)] if total else []

    for f in list(incl):
        if f.split(" (")[0].startswith(_PLUMBING):
            del incl[f]  # the event loop, click and Faust's worker entry: every sample has them
    return {
        "samples": total,
        "active_pct": round(100 * total / (seconds * rate), 1) if seconds else None,
        "own": pct(own),
        "inclusive": pct(incl),
        "own_by_file": pct(by_file),
    }


_PLUMBING = (
    "BaseEventLoop.",
    "Handle._run",
    "Context.invoke",
    "Command.",
    "Group.invoke",
    "_run_code",
    "_run_module_as_main",
    "<module>",
    "Worker.execute_from_commandline",
    "App.main",
    "pass_context.",
    "Service._execute_task",
    "Worker.",
    "Service.",
)


def run_scenario(cfg: ScenarioConfig) -> dict[str, Any]:
    """One run of the real stack against the simulated cluster; raw records, evaluated later."""
    from bus.publish import Publisher
    from sim.cluster import ClusterConfig, SimCluster
    from trainmedic.settings import Settings
    from trainmedic.stack.runtime import Stack, StackConfig

    root = Path(cfg.data_dir) / cfg.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    policy = root / "policy.yaml"
    policy.write_text(BENCH_POLICY)
    cluster = SimCluster(
        ClusterConfig(
            nodes=cfg.nodes,
            seed=cfg.seed,
            transport=cfg.transport,  # type: ignore[arg-type]
            payload=cfg.payload,  # type: ignore[arg-type]
            root=root / "cluster",
            job_sizes=tuple((int(s), float(w)) for s, w in cfg.job_sizes),
            nccl_timeout_s=cfg.nccl_timeout_s,
            requeue_delay_s=cfg.requeue_delay_s,
            backdate_s=cfg.backdate_s,
            first_step_extra_s=(cfg.first_step_extra_s[0], cfg.first_step_extra_s[1]),
            gpu_summary_every_s=cfg.gpu_summary_every_s,
        )
    )
    t_stack = time.time()
    stack = Stack(
        StackConfig(
            data_dir=root,
            policy=policy,
            mode="autonomous",
            settle_s=cfg.settle_s,
            collateral_wait_s=cfg.collateral_wait_s,
            verify_timeout_s=60.0,
            workers=cfg.workers,
        ),
        cluster.sched,
    ).start()
    startup_s = time.time() - t_stack
    assert stack.store is not None
    publisher = Publisher(stack.bootstrap, "bench-sim")
    sampler = ProcSampler()
    prober = Prober(stack.bootstrap, cfg.probe_interval_s, Settings.load().topic_partitions)
    profile: dict[str, Any] | None = None
    try:
        sampler.start()
        cluster.start(publisher)
        prober.start()
        injections = (
            cluster.plan(
                cfg.kinds,
                reps=cfg.reps,
                start_s=cfg.start_s,
                spacing_s=cfg.spacing_s,
                hang_at_s=cfg.hang_at_s,
                straggler_at_s=cfg.straggler_at_s,
                healthy_min=cfg.healthy_min,
            )
            if cfg.kinds
            else []
        )
        deadline = max([cfg.min_duration_s] + [i.at_s + resolve_budget_s(i.kind, cfg) for i in injections])
        log.info(
            "%s: %d nodes, %d jobs, %d injections, up to %.0f s",
            cfg.name,
            cfg.nodes,
            len(cluster.jobs),
            len(injections),
            deadline,
        )
        profiler: threading.Thread | None = None
        prof_box: dict[str, Any] = {}
        if cfg.profile_s > 0 and "worker" in sampler.pids:
            pid = sampler.pids["worker"]

            def run_profile() -> None:
                time.sleep(cfg.profile_at_s)
                prof_box.update(_profile(pid, cfg.profile_s, root / "streams-worker.pyspy.txt"))

            profiler = threading.Thread(target=run_profile, name="bench-profiler", daemon=True)
            profiler.start()
        last_check = 0.0
        while True:
            time.sleep(1.0)
            stack.check_alive()
            elapsed = time.time() - cluster.t0
            if elapsed >= deadline:
                break
            if elapsed >= cfg.min_duration_s and injections and time.time() - last_check > 5:
                last_check = time.time()
                if _all_resolved(stack.store, injections, cfg):
                    break
        if profiler is not None:
            profiler.join(timeout=cfg.profile_s + 90)
            profile = prof_box or {"error": "the profile did not finish"}
        sim_end = time.time()
        cluster.stop()
        prober.stop()
        publisher.flush(10)
        # How long the pipeline needs to catch up once the cluster stops: one last probe round.
        final_seq = prober.send_round()
        prober._producer.flush(10)
        drain_s = _wait_probes(stack.store, prober, final_seq, timeout_s=120.0)
        sampler.stop()
        time.sleep(1.0)  # the audit sink's last batch
        audit = _query_audit(stack.store)
    finally:
        with contextlib.suppress(Exception):
            cluster.stop()
        stack.stop()
    return {
        "config": dataclasses.asdict(cfg),
        "cluster": cluster.summary(),
        "startup_s": round(startup_s, 2),
        "t0": cluster.t0,
        "sim_end": sim_end,
        "duration_s": round(sim_end - cluster.t0, 1),
        "injections": [i.as_dict() for i in cluster.injections],
        "victims": sorted({i.job_id for i in cluster.injections}),
        "jobs": cluster.job_nodes(),
        "sched_log": [dataclasses.asdict(r) for r in cluster.sched_log],
        "sent": dict(cluster.sent + publisher.sent),  # direct publishes + the real tailers' (files)
        "lines_written": cluster.lines_written,
        "late_gpu_samples": cluster.late_gpu_samples,
        "max_tick_lag_s": round(cluster.max_tick_lag_s, 3),
        "publisher_dropped": dict(publisher.dropped),
        "probes": _probe_results(audit["dead_letters"], prober.sent),
        "drain_s": None if drain_s is None else round(drain_s, 2),
        "proc": sampler.rows,
        "audit": {k: v for k, v in audit.items() if k != "dead_letters"},
        "profile": profile,
    }


def _all_resolved(store: Any, injections: Sequence[Any], cfg: ScenarioConfig) -> bool:
    """Every injection has an incident and, where one was decided, its action result (or ran out of time)."""
    incidents = store.query(
        f"SELECT incident_id, job_id, category, {_secs('event_time')} AS t FROM {{db}}.incidents FINAL ORDER BY t"
    )
    decided = {r["incident_id"]: r["kind"] for r in store.query("SELECT incident_id, kind FROM {db}.decisions FINAL")}
    done = {r["incident_id"] for r in store.query("SELECT incident_id FROM {db}.action_results FINAL")}
    now = time.time()
    for inj in injections:
        if inj.skipped:
            continue
        if inj.injected_at is None:
            return False
        if now - inj.injected_at > resolve_budget_s(inj.kind, cfg):
            continue
        match = [r for r in incidents if r["job_id"] == inj.job_id and float(r["t"]) >= inj.injected_at - 1]
        if not match:
            return False
        judged = _judged(match)
        if judged["category"] == "unknown":
            return False  # a cause may still be named (a straggler after the job-wide slowdown)
        iid = judged["incident_id"]
        if iid not in decided or (decided[iid] == "action" and iid not in done):
            return False
    return True


def _judged(match: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of a job's incidents after a fault (in time order), the one its outcome is judged on: the
    first that names a cause, else the first. An incident that found none (unknown) is followed by
    one of its own when an isolating cause is named later (streams/attribution.py)."""
    return next((r for r in match if r["category"] != "unknown"), match[0])


# --- evaluation --------------------------------------------------------------------------------------


def pctl(values: Iterable[float], q: float) -> float | None:
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values: Iterable[float | None]) -> dict[str, Any]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"n": 0, "p50": None, "p95": None, "max": None, "mean": None}
    return {
        "n": len(xs),
        "p50": _r3(pctl(xs, 0.5)),
        "p95": _r3(pctl(xs, 0.95)),
        "max": _r3(max(xs)),
        "mean": _r3(statistics.fmean(xs)),
    }


def _r3(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


@dataclass(frozen=True)
class BaselineAssumptions:
    """The status quo without trainmedic, for the same faults. Every figure is an assumption."""

    nccl_watchdog_s: float = 600.0  # torch's default NCCL timeout: the waiting ranks abort then
    manual_response_s: float = 1800.0  # a person sees the failed job, finds the cause, resubmits
    silent_notice_s: float = 3600.0  # a fault that fails nothing (hang outside NCCL, straggler, NaN) is noticed
    requeue_delay_s: float = 1.0  # as the simulated scheduler (Slurm: cred_expire)

    def detect_s(self, baseline: str) -> float:
        return {"watchdog": self.nccl_watchdog_s, "crash": 0.0, "silent": self.silent_notice_s}[baseline]


RECOVER_ACTIONS = ("drain_and_requeue", "requeue")


def evaluate(raw: dict[str, Any], assume: BaselineAssumptions | None = None) -> dict[str, Any]:
    """Outcome of each injection, per-kind and overall figures, status quo, throughput, lag, CPU."""
    from sim.faults import FAULTS

    assume = assume or BaselineAssumptions(requeue_delay_s=raw["config"]["requeue_delay_s"])
    audit = raw["audit"]
    incidents = audit["incidents"]
    decisions = {d["incident_id"]: d for d in audit["decisions"]}
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in audit["results"]:
        results[r["incident_id"]].append(r)
    sched = raw["sched_log"]
    victims = set(raw["victims"])
    culprits = {i["culprit"] for i in raw["injections"] if i["culprit"]}
    outcomes: list[dict[str, Any]] = []
    used: set[str] = set()
    for inj in raw["injections"]:
        spec = FAULTS[inj["kind"]]
        o: dict[str, Any] = {
            "kind": inj["kind"],
            "job_id": inj["job_id"],
            "node": inj["node"],
            "rank": inj["rank"],
            "job_gpus": inj["job_gpus"],
            "expected_category": inj["category"],
            "expected_action": inj["expected_action"],
            "expected_culprit": inj["culprit"],
            "skipped": inj["skipped"],
        }
        outcomes.append(o)
        if inj["skipped"] or inj["injected_at"] is None:
            continue
        t_f, t_sig = inj["injected_at"], inj["signal_at"]
        match = sorted(
            (r for r in incidents if r["job_id"] == inj["job_id"] and float(r["t"]) >= t_f - 1.0),
            key=lambda r: float(r["t"]),
        )
        if not match:
            o["detected"] = False
            continue
        inc = _judged(match)
        used.update(r["incident_id"] for r in match[: match.index(inc) + 1])
        o.update(
            detected=True,
            incident_id=inc["incident_id"],
            category=inc["category"],
            culprit=inc["culprit_node"],
            confidence=float(inc["confidence"]),
            # Detection: the first incident (a person is told); the outcome: the judged one.
            detection_s=round(float(match[0]["t"]) - t_sig, 3),
            diagnosis_s=round(float(inc["t"]) - t_sig, 3),
            fault_to_incident_s=round(float(inc["t"]) - t_f, 3),
            category_ok=inc["category"] == inj["category"],
            culprit_ok=None if not inj["culprit"] else inc["culprit_node"] == inj["culprit"],
            culprit_in_explanation=bool(inj["culprit"]) and inj["culprit"] in (inc["explanation"] or ""),
            incidents_on_job=len(match),
        )
        dec = decisions.get(inc["incident_id"])
        if dec is not None:
            o.update(decision_kind=dec["kind"], action=dec["action"], rule=dec["rule"])
        res = results.get(inc["incident_id"], [])
        if res:
            o.update(
                result_status=[r["status"] for r in res],
                action_latency_s=max(
                    (float(r["action_latency_s"]) for r in res if r["action_latency_s"] is not None), default=None
                ),
            )
        o["action_ok"] = bool(
            dec is not None
            and dec["kind"] == "action"
            and dec["action"] == inj["expected_action"]
            and res
            and all(r["status"] == "done" for r in res)
        )
        # End to end, from the scheduler's own record.
        later = [s for s in sched if s["job_id"] == inj["job_id"] and s["t"] >= t_f]
        again = next((s for s in later if s["change"] == "RUNNING" and s["restarts"] > inj["run_before"]), None)
        stopped = next((s for s in later if s["change"] in ("CANCELLED", "FAILED", "NODE_FAIL")), None)
        if again is not None:
            o["running_again_s"] = round(again["t"] - t_f, 3)
            o["relanded_on_culprit"] = bool(inj["culprit"]) and inj["culprit"] in again["nodes"]
        if stopped is not None:
            o["stopped_s"] = round(stopped["t"] - t_f, 3)
            o["stopped_by"] = stopped["change"]
        o["baseline"] = _baseline_one(inj, spec.baseline, spec.persistent, spec.kind, assume, raw)
        o["trainmedic_gpu_h"] = _trainmedic_gpu_h(o, inj, assume, raw)
    # Incidents and actions that no injection explains.
    false_incidents = [
        {
            "incident_id": r["incident_id"],
            "job_id": r["job_id"],
            "category": r["category"],
            "culprit": r["culprit_node"],
        }
        for r in incidents
        if r["incident_id"] not in used
    ]
    actions_on_healthy = [
        {"incident_id": r["incident_id"], "job_id": r["job_id"], "action": r["action"], "status": r["status"]}
        for r in audit["results"]
        if r["job_id"] not in victims
    ]
    innocent_drains = [
        {"incident_id": r["incident_id"], "node": r["node"], "job_id": r["job_id"]}
        for r in audit["results"]
        if r["action"] == "drain_and_requeue" and r["node"] and r["node"] not in culprits
    ]
    by_kind: dict[str, Any] = {}
    for kind in dict.fromkeys(o["kind"] for o in outcomes):
        by_kind[kind] = _aggregate([o for o in outcomes if o["kind"] == kind], FAULTS[kind].baseline)
    overall = _aggregate(outcomes, None)
    lag = _lag(raw)
    steady_from = raw["t0"] + raw["config"]["steady_after_s"]
    secs = max(raw["duration_s"], 1e-6)
    sent = raw["sent"]
    inputs = sum(sent.values())
    return {
        "name": raw["config"]["name"],
        "cluster": raw["cluster"],
        "duration_s": raw["duration_s"],
        "startup_s": raw["startup_s"],
        "outcomes": outcomes,
        "by_kind": by_kind,
        "overall": overall,
        "false_incidents": false_incidents,
        "actions_on_healthy_jobs": actions_on_healthy,
        "innocent_drains": innocent_drains,
        "throughput": {
            "input_events_per_s": round(inputs / secs, 1),
            "by_topic_per_s": {k: round(v / secs, 1) for k, v in sorted(sent.items())},
            "log_lines_per_s": round(raw["lines_written"] / secs, 1),
            "gpu_samples_per_s": round(sent.get("gpu.samples", 0) / secs, 1),
            "gpus_reported_per_s": round(8 * sent.get("gpu.samples", 0) / secs, 1),
            "late_gpu_samples": raw["late_gpu_samples"],
            "sim_max_tick_lag_s": raw["max_tick_lag_s"],
            "publisher_dropped": raw["publisher_dropped"],
        },
        "lag": lag,
        "drain_s": raw["drain_s"],
        "resources": cpu_summary(raw["proc"], steady_from, raw["sim_end"]),
        "anomaly_lag_s": dist(
            float(a["produced"]) - float(a["t"])
            for a in raw["audit"]["anomalies"]
            if a["detector"] in ("signatures", "xid")
        ),
        "anomalies_by_signature": dict(Counter(a["signature"] for a in raw["audit"]["anomalies"]).most_common()),
        "profile": raw.get("profile"),
        "assumptions": dataclasses.asdict(assume),
    }


def _lag(raw: dict[str, Any]) -> dict[str, Any]:
    steady_from = raw["t0"] + raw["config"]["steady_after_s"]
    probes = raw["probes"]
    out: dict[str, Any] = {"bound_s": LAG_BOUND_S, "agents": {}, "series": {}}
    for topic in PROBE_TOPICS:
        ps = [p for p in probes if p["topic"] == topic and p["sent_at"] <= raw["sim_end"]]
        steady = [p for p in ps if p["sent_at"] >= steady_from]
        lost = [p for p in steady if p["lag_s"] is None]
        d = dist(p["lag_s"] for p in steady)
        d["unanswered"] = len(lost)
        out["agents"][AGENT_OF_TOPIC[topic]] = d
        series: dict[int, float] = {}
        for p in ps:
            if p["lag_s"] is None:
                continue
            sec = int(p["sent_at"] - raw["t0"])
            series[sec] = max(series.get(sec, 0.0), p["lag_s"])
        out["series"][AGENT_OF_TOPIC[topic]] = sorted(series.items())
    worst = [a["max"] for a in out["agents"].values() if a["max"] is not None]
    out["max_s"] = max(worst) if worst else None
    out["bounded"] = (
        bool(worst) and max(worst) < LAG_BOUND_S and all(a["unanswered"] == 0 for a in out["agents"].values())
    )
    return out


def _baseline_one(
    inj: dict[str, Any], trigger: str, persistent: bool, kind: str, a: BaselineAssumptions, raw: dict[str, Any]
) -> dict[str, Any]:
    """The status quo for this injection: when it is known, when the job runs (or is stopped), GPU hours."""
    gpus = inj["job_gpus"]
    detect = a.detect_s(trigger)
    k = len(inj["job_nodes"])
    free = inj["free_nodes"]
    # A plain requeue picks k nodes among the free ones and the job's own (the bad one included).
    p_random = k / (free + k) if persistent else 0.0
    out: dict[str, Any] = {"trigger": trigger, "detect_s": detect, "isolates": False}
    if inj["expected_action"] in RECOVER_ACTIONS:
        once = detect + a.manual_response_s + a.requeue_delay_s
        expected = once / (1 - p_random) if p_random < 1 else math.inf
        out.update(
            running_again_s=round(once, 1),
            running_again_expected_s=round(expected, 1),
            p_reland_random=round(p_random, 3),
            first_fit_relands=bool(inj["first_fit_relands"]) and persistent,
        )
        if kind == "straggler":
            slow = raw["cluster"].get("straggler_slowdown", 1.35)
            lost_s = (1 - 1 / slow) * (detect + a.manual_response_s) + a.requeue_delay_s
            out["gpu_h"] = round(gpus * lost_s / 3600 / max(1 - p_random, 1e-9), 2)
        else:
            out["gpu_h"] = round(gpus * expected / 3600, 2)
    else:
        # Stop-class faults need a fix by a person on both sides; count GPU time until the allocation ends.
        out["stopped_s"] = detect
        out["gpu_h"] = round(gpus * detect / 3600, 2)
    return out


def _trainmedic_gpu_h(
    o: dict[str, Any], inj: dict[str, Any], a: BaselineAssumptions, raw: dict[str, Any]
) -> float | None:
    gpus = inj["job_gpus"]
    if o.get("decision_kind") != "action" or not o.get("action_ok"):
        # Recommended only, or not acted on: the status quo applies to this fault.
        base = o.get("baseline") or {}
        return base.get("gpu_h")
    if inj["expected_action"] in RECOVER_ACTIONS:
        t = o.get("running_again_s")
        if t is None:
            return None
        if inj["kind"] == "straggler":
            slow = raw["cluster"].get("straggler_slowdown", 1.35)
            det = o.get("fault_to_incident_s") or 0.0
            return round(gpus * ((1 - 1 / slow) * det + (t - det)) / 3600, 3)
        return round(gpus * t / 3600, 3)
    t = o.get("stopped_s")
    return None if t is None else round(gpus * t / 3600, 3)


def _aggregate(os_: list[dict[str, Any]], trigger: str | None) -> dict[str, Any]:
    done = [o for o in os_ if not o.get("skipped") and "detected" in o]
    det = [o for o in done if o.get("detected")]

    def rate(key: str) -> float | None:
        xs = [o[key] for o in det if o.get(key) is not None]
        return round(sum(1 for x in xs if x) / len(xs), 3) if xs else None

    recover = [o for o in det if o["expected_action"] in RECOVER_ACTIONS]
    stop = [o for o in det if o["expected_action"] not in RECOVER_ACTIONS]
    base = [o["baseline"] for o in done if "baseline" in o]
    return {
        "injected": len(done),
        "skipped": sum(1 for o in os_ if o.get("skipped")),
        "detected": len(det),
        "detection_s": dist(o["detection_s"] for o in det),
        "fault_to_incident_s": dist(o["fault_to_incident_s"] for o in det),
        "action_s": dist(o.get("action_latency_s") for o in det),
        "running_again_s": dist(o.get("running_again_s") for o in recover),
        "stopped_s": dist(o.get("stopped_s") for o in stop if o.get("decision_kind") == "action"),
        "category_accuracy": rate("category_ok"),
        "culprit_accuracy": rate("culprit_ok"),
        "culprit_in_explanation": rate("culprit_in_explanation")
        if any(o.get("expected_culprit") for o in det)
        else None,
        "action_accuracy": rate("action_ok"),
        "executed": sum(1 for o in det if o.get("decision_kind") == "action"),
        "recommended_only": sum(1 for o in det if o.get("decision_kind") == "recommendation"),
        "relanded_on_culprit": sum(1 for o in recover if o.get("relanded_on_culprit")),
        "gpu_h_per_fault": dist(o.get("trainmedic_gpu_h") for o in done),
        "baseline": {
            "trigger": trigger,
            "detect_s": dist(b["detect_s"] for b in base),
            "running_again_s": dist(b.get("running_again_s") for b in base),
            "running_again_expected_s": dist(b.get("running_again_expected_s") for b in base),
            "p_reland_random": dist(b.get("p_reland_random") for b in base),
            "first_fit_relands": sum(1 for b in base if b.get("first_fit_relands")),
            "gpu_h_per_fault": dist(b.get("gpu_h") for b in base),
        },
    }


# --- scale search -------------------------------------------------------------------------------------
# The default search grows until a size is not sustained (it stops at the first that fails); the
# last size is NVSentinel's published 5,000-node scale and beyond.
DEFAULT_SCALE = [64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192]

SCALE_KINDS = ["xid79", "xid48_dbe", "cuda_oom", "ib_link_flap", "storage_full", "node_not_responding"]


def scale_config(nodes: int, seconds: float, data_dir: str, seed: int) -> ScenarioConfig:
    return ScenarioConfig(
        name=f"scale-{nodes}",
        nodes=nodes,
        seed=seed,
        kinds=list(SCALE_KINDS),
        reps=1,
        job_sizes=[[2, 0.35], [4, 0.35], [8, 0.2], [16, 0.1]],
        min_duration_s=seconds,
        start_s=15.0,
        spacing_s=max(3.0, (seconds - 25.0) / len(SCALE_KINDS)),
        backdate_s=300.0,  # the jobs were already running: detectors past their warm-up
        data_dir=data_dir,
        healthy_min=2,
    )


def sustained(ev: dict[str, Any], ref_p95: float | None) -> tuple[bool, str]:
    lag = ev["lag"]
    why = []
    if not lag["bounded"]:
        why.append(f"lag max {lag['max_s']} s >= {LAG_BOUND_S} s or probes unanswered")
    if ev["drain_s"] is None or ev["drain_s"] > LAG_BOUND_S + 1.0:
        why.append(f"catch-up after stop {ev['drain_s']} s")
    ov = ev["overall"]
    if ov["detected"] < ov["injected"]:
        why.append(f"detected {ov['detected']}/{ov['injected']}")
    p95 = ov["detection_s"]["p95"]
    if ref_p95 is not None and p95 is not None and p95 > max(1.5 * ref_p95, ref_p95 + 1.0):
        why.append(f"detection p95 {p95} s vs {ref_p95} s at the smallest size")
    if ev["throughput"]["late_gpu_samples"] > 0:
        why.append(f"the simulator fell behind ({ev['throughput']['late_gpu_samples']} GPU samples late)")
    return (not why), "; ".join(why) or "ok"


# --- simulator publishing cost: the one part of the pipeline this benchmark owns --------------------------


def payload_microbench(nodes: int, seconds: float = 10.0) -> dict[str, Any]:
    """CPU per simulated second of building and encoding the events of `nodes` nodes, with pydantic
    models (schemas.codec.encode, as producers do) vs. prebuilt JSON objects (this simulator's
    default). The simulator is stepped over simulated time without sleeping; nothing is sent."""
    from sim.cluster import ClusterConfig, SimCluster

    class Null:
        def __init__(self) -> None:
            self.n = 0
            self.bytes = 0

        def publish_raw(self, topic_name: str, payload: bytes, key: bytes | None = None) -> None:
            self.n += 1
            self.bytes += len(payload)

    out: dict[str, Any] = {"nodes": nodes, "simulated_s": seconds}
    for payload in ("model", "fast"):
        sink = Null()
        t = time.time()
        c = SimCluster(
            ClusterConfig(
                nodes=nodes,
                seed=1,
                payload=payload,  # type: ignore[arg-type]
                backdate_s=300.0,
                job_sizes=((2, 0.35), (4, 0.35), (8, 0.2), (16, 0.1)),
            ),
            sink,
        ).prepare(now=t)
        cpu0 = time.process_time()
        sim_t = t
        while sim_t < t + seconds:
            sim_t += c.cfg.tick_s
            c.step(sim_t)
        cpu = time.process_time() - cpu0
        out[payload] = {
            "events": sink.n,
            "mb": round(sink.bytes / 1e6, 2),
            "cpu_s_per_simulated_s": round(cpu / seconds, 4),
            "us_per_event": round(1e6 * cpu / max(sink.n, 1), 1),
            "pct_of_one_core": round(100 * cpu / seconds, 1),
        }
    return out


# --- orchestration ---------------------------------------------------------------------------------------


def run_child(cfg: ScenarioConfig, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one scenario in its own process (its own chDB folder, its own /proc figures)."""
    cfg_path = out_dir / f".{cfg.name}.config.json"
    raw_path = out_dir / f".{cfg.name}.raw.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    raw_path.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--child", str(cfg_path), "--child-out", str(raw_path)],
        cwd=REPO,
        timeout=timeout_s,
        check=False,
    )
    cfg_path.unlink(missing_ok=True)
    if proc.returncode != 0 or not raw_path.exists():
        raise RuntimeError(f"scenario {cfg.name} failed (exit {proc.returncode}); see the output above")
    raw: dict[str, Any] = orjson.loads(raw_path.read_bytes())
    raw_path.unlink(missing_ok=True)
    return raw


@dataclass
class BenchOptions:
    quick: bool = False
    nodes: int = 128
    reps: int = 2
    seed: int = 7
    kinds: list[str] | None = None
    transport: str = "direct"
    scale: list[int] | None = None  # None: the default search (not in --quick), until a size fails
    workers: int = 1
    scale_seconds: float = 150.0
    profile_seconds: float = 30.0
    out: Path = RESULTS
    data_dir: Path = REPO / "var" / "bench"
    manual_response_s: float = 1800.0
    silent_notice_s: float = 3600.0
    prefix: str = "pipeline"
    gpu_summary_every_s: float | None = None
    say: Callable[[str], None] = print


def main_config(o: BenchOptions) -> ScenarioConfig:
    from sim.faults import ALL_KINDS, EXPLICIT_KINDS

    if o.kinds:
        kinds = list(o.kinds)
    elif o.quick:
        kinds = [*EXPLICIT_KINDS, "hang"]
    else:
        kinds = list(ALL_KINDS)
    return ScenarioConfig(
        name="quick" if o.quick else "main",
        nodes=o.nodes,
        seed=o.seed,
        kinds=kinds,
        reps=o.reps,
        transport=o.transport,
        job_sizes=[[2, 0.7], [3, 0.3]] if o.quick else [[2, 0.45], [3, 0.25], [4, 0.30]],
        first_step_extra_s=[5.0, 10.0] if o.quick else [12.0, 25.0],
        start_s=20.0 if o.quick else 25.0,
        spacing_s=2.5 if o.quick else 4.0,
        hang_at_s=30.0 if o.quick else 60.0,
        straggler_at_s=200.0,
        nccl_timeout_s=10.0 if o.quick else 600.0,
        data_dir=str(o.data_dir),
        healthy_min=2 if o.quick else 3,
        gpu_summary_every_s=o.gpu_summary_every_s,
    )


def run_bench(o: BenchOptions) -> dict[str, Any]:
    from bench.report import render

    o.out.mkdir(parents=True, exist_ok=True)
    assume = BaselineAssumptions(manual_response_s=o.manual_response_s, silent_notice_s=o.silent_notice_s)
    doc: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.pipeline " + " ".join(sys.argv[1:]),
        "quick": o.quick,
        "gpu_summary_every_s": o.gpu_summary_every_s,
    }
    cfg = main_config(o)
    o.say(f"[bench] scenario {cfg.name}: {cfg.nodes} nodes x 8 GPUs, {len(cfg.kinds)} fault kinds x {cfg.reps}")
    t = time.time()
    raw = run_child(cfg, o.out, timeout_s=1800)
    main_ev = evaluate(raw, dataclasses.replace(assume, requeue_delay_s=cfg.requeue_delay_s))
    doc["main"] = main_ev
    o.say(f"[bench] {cfg.name} done in {time.time() - t:.0f} s: {_oneline(main_ev)}")
    sizes = o.scale if o.scale is not None else ([] if o.quick else DEFAULT_SCALE)
    scale: list[dict[str, Any]] = []
    ref_p95: float | None = None
    largest: int | None = None
    first_fail: int | None = None
    for n in sizes:
        scfg = scale_config(n, o.scale_seconds, str(o.data_dir), o.seed)
        scfg.workers = o.workers
        scfg.gpu_summary_every_s = o.gpu_summary_every_s
        o.say(f"[bench] scale: {n} nodes ({n * 8} GPUs) for {o.scale_seconds:.0f} s")
        ev = evaluate(run_child(scfg, o.out, timeout_s=900), dataclasses.replace(assume))
        ok, why = sustained(ev, ref_p95)
        if ref_p95 is None:
            ref_p95 = ev["overall"]["detection_s"]["p95"]
        scale.append({"nodes": n, "gpus": n * 8, "sustained": ok, "why": why, **_scale_row(ev)})
        o.say(f"[bench] scale {n}: {'sustained' if ok else 'NOT sustained'} ({why}); {_oneline(ev)}")
        if ok:
            largest = n
        else:
            first_fail = n
            break
    doc["scale"] = {
        "rows": scale,
        "largest_sustained_nodes": largest,
        "first_failing_nodes": first_fail,
        "seconds": o.scale_seconds,
    }
    prof_n = first_fail or largest
    if prof_n and o.profile_seconds > 0:
        # Profile once the straggler window (120 s) is full: that is the steady state.
        pcfg = scale_config(prof_n, 130.0 + o.profile_seconds, str(o.data_dir), o.seed)
        pcfg.name = f"profile-{prof_n}"
        pcfg.gpu_summary_every_s = o.gpu_summary_every_s
        pcfg.profile_s = o.profile_seconds
        pcfg.profile_at_s = 125.0
        o.say(f"[bench] profiling the streams worker at {prof_n} nodes for {o.profile_seconds:.0f} s (py-spy)")
        pev = evaluate(run_child(pcfg, o.out, timeout_s=900), assume)
        doc["profile"] = {
            "nodes": prof_n,
            "sustained_during_profile": sustained(pev, ref_p95)[0],
            **(pev["profile"] or {}),
        }
        doc["profile"]["resources"] = pev["resources"]
    if not o.quick:
        o.say("[bench] simulator publishing cost: pydantic models vs prebuilt JSON")
        doc["payload_microbench"] = payload_microbench(largest or 256)
    json_path = o.out / f"{o.prefix}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = render(doc, o.out, o.prefix)
    common = results.record(
        "pipeline",
        figures.pipeline(doc),
        root=o.out,
        started=doc["measured_at"],
        machine=doc["machine"],
        details=doc,
        variant=results.variant_name(o.prefix, "pipeline"),
        report=md,
    )
    o.say(f"[bench] wrote {json_path}, {md} and {common}")
    return doc


def _scale_row(ev: dict[str, Any]) -> dict[str, Any]:
    return {
        "jobs": ev["cluster"]["jobs"],
        "input_events_per_s": ev["throughput"]["input_events_per_s"],
        "log_lines_per_s": ev["throughput"]["log_lines_per_s"],
        "gpu_samples_per_s": ev["throughput"]["gpu_samples_per_s"],
        "lag": {k: v for k, v in ev["lag"]["agents"].items()},
        "lag_series": ev["lag"]["series"],
        "lag_max_s": ev["lag"]["max_s"],
        "drain_s": ev["drain_s"],
        "detection_s": ev["overall"]["detection_s"],
        "action_s": ev["overall"]["action_s"],
        "detected": ev["overall"]["detected"],
        "injected": ev["overall"]["injected"],
        "category_accuracy": ev["overall"]["category_accuracy"],
        "resources": ev["resources"],
        # GPUs served per core of the central pipeline (workers + broker + sinks) at 1 Hz.
        "gpus_per_central_core": (
            round(ev["cluster"]["nodes"] * 8 / (ev["resources"]["central_cpu_pct"] / 100.0))
            if ev["resources"].get("central_cpu_pct")
            else None
        ),
        "late_gpu_samples": ev["throughput"]["late_gpu_samples"],
        "duration_s": ev["duration_s"],
    }


def _oneline(ev: dict[str, Any]) -> str:
    ov = ev["overall"]
    d = ov["detection_s"]
    return (
        f"detected {ov['detected']}/{ov['injected']}, detection p50 {d['p50']} s p95 {d['p95']} s, "
        f"category {ov['category_accuracy']}, lag max {ev['lag']['max_s']} s, "
        f"{ev['throughput']['input_events_per_s']} events/s, worker CPU {ev['resources']['cpu_pct'].get('worker')} %"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="small cluster, explicit faults and hangs, no straggler, no scale search"
    )
    p.add_argument("--nodes", type=int, default=None, help="cluster size of the accuracy/latency scenario")
    p.add_argument("--reps", type=int, default=None, help="injections per fault kind")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--kinds", default=None, help="comma-separated fault kinds (default: all; --quick: all but straggler)"
    )
    p.add_argument(
        "--transport", choices=("direct", "files"), default=None, help="files: real files and the real tailers"
    )
    p.add_argument("--scale", default=None, help="comma-separated node counts for the scale search ('' for none)")
    p.add_argument("--workers", type=int, default=1, help="streams workers in the scale search (one consumer group)")
    p.add_argument(
        "--scale-seconds",
        type=float,
        default=150.0,
        help="per size; >= 130 s, or the straggler detector's 120 s window is not full and its cost is understated",
    )
    p.add_argument(
        "--gpu-summary-every",
        type=float,
        default=None,
        metavar="S",
        help="edge aggregation in every scenario: each node's GPUs read every second, published every S s "
        "and at once on a health change or Xid (produce gpu --summary-every)",
    )
    p.add_argument("--profile-seconds", type=float, default=30.0)
    p.add_argument("--manual-response-s", type=float, default=1800.0, help="status quo: person's response time")
    p.add_argument("--silent-notice-s", type=float, default=3600.0, help="status quo: when a silent fault is noticed")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--prefix", default="pipeline", help="output file names: PREFIX.json, PREFIX.md, PREFIX_*.png")
    p.add_argument("--data-dir", type=Path, default=REPO / "var" / "bench")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def options_from_args(a: argparse.Namespace) -> BenchOptions:
    from sim.faults import ALL_KINDS

    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()] if a.kinds else None
    for k in kinds or []:
        if k not in ALL_KINDS:
            raise SystemExit(f"--kinds: unknown fault kind {k!r} (known: {', '.join(ALL_KINDS)})")
    scale = None if a.scale is None else [int(x) for x in a.scale.split(",") if x.strip()]
    if a.gpu_summary_every is not None:
        from producers.gpu_edge import MAX_EVERY_S

        if not 1.0 <= a.gpu_summary_every <= MAX_EVERY_S:
            raise SystemExit(f"--gpu-summary-every: from 1 (the sampling interval) to {MAX_EVERY_S:g} s")
    return BenchOptions(
        quick=a.quick,
        nodes=a.nodes or (48 if a.quick else 128),
        reps=a.reps or (1 if a.quick else 2),
        seed=a.seed,
        kinds=kinds,
        transport=a.transport or ("files" if a.quick else "direct"),
        scale=scale,
        workers=a.workers,
        scale_seconds=a.scale_seconds,
        profile_seconds=0.0 if a.quick and scale is None else a.profile_seconds,
        out=a.out,
        data_dir=a.data_dir,
        manual_response_s=a.manual_response_s,
        silent_notice_s=a.silent_notice_s,
        prefix=a.prefix,
        gpu_summary_every_s=a.gpu_summary_every,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = parse_args(argv)
    if a.child:
        logging.getLogger("trainmedic.bench").setLevel(logging.INFO)
        raw = run_scenario(ScenarioConfig.from_dict(json.loads(a.child.read_text())))
        a.child_out.write_bytes(orjson.dumps(raw, option=orjson.OPT_SERIALIZE_NUMPY, default=str))
        return 0
    run_bench(options_from_args(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
