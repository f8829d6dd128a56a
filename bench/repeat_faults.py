"""Repeat-fault benchmark (not a test): faults that come back, with and without trainmedic.

Each scenario starts the real Stack (embedded Tansu broker, Faust streams worker subprocess,
executor, chDB audit sink) in autonomous mode with the simulated Slurm of sim.cluster as the
executor's backend, runs a small simulated cluster whose job output goes through real files and
the real job-log and kernel-log tailers (progress lines become ProgressBatch records there), and
injects faults that recur:

- ``no_progress``: one job's rank dies silently at the same training step in every attempt (a
  data-dependent crash such as a host OOM kill at a fixed batch); the other ranks wait in NCCL.
  trainmedic's hang detector finds the stall, policy requeues the job, the job resumes from its
  last checkpoint, replays steps below its best one and dies again; after
  ``restart_budget.no_progress_limit`` restarts in a row without progress policy stops it.
- ``bad_node``: a node whose GPU falls off the bus (Xid 79) whenever a job has run on it for a
  while. trainmedic drains it at the first fault and requeues the job without it; the next job
  the scheduler starts (B, submitted once A's fault is over) must not get the node.
- ``follows_job``: an Xid 79 on a different node of one job in every attempt (the cause travels
  with the job). trainmedic drains the first node, and on the second fault recommends a stop
  instead of draining node after node.
- ``predictive`` (issue 44): GPU faults with a warning ahead of some of them, on a simulated
  fleet in virtual time (bench/predictive.py, sim/prefailure_fleet.py), not on the stack. Reactive
  path against a migration at the next checkpoint, with the drains and requeues that false
  warnings cost, swept over lead time and precision: where migration stops paying.

Every trainmedic figure (faults, restarts, decisions, detection, action, downtime, GPU-hours) is
read from the audit trail (incidents, decisions, action_results, job_attempts) and the simulated
scheduler's own record of the run. The status quo (no trainmedic) is a stated model
(`StatusQuo`), with the per-fault assumptions of bench/pipeline.py's baseline, replayed in
virtual time over the same job timings and, for node placement, the same scheduler code.

Time compression: trainmedic's latencies are real; the jobs' timings (step time, start-up,
checkpoint pauses, how long an attempt runs before it fails) are simulated and compressed, the
same on both sides. NCCL's watchdog keeps its real 600 s in the simulator (trainmedic acts
before it fires), except in ``follows_job``'s last stall, which is not waited for (see there).

Run: .venv/bin/python -m bench.repeat_faults [--scenarios no_progress,bad_node,follows_job,predictive] [--limit N]
Writes bench/results/repeat-faults.json and repeat-faults.md (see --out, --prefix), and the result in the common
format, bench/results/repeat_faults/<date>-<commit>.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import heapq
import json
import logging
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench import predictive

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GPUS_PER_NODE = 8
SCENARIOS = ("no_progress", "bad_node", "follows_job", "predictive")
STACK_SCENARIOS = SCENARIOS[:3]  # run against the real stack; predictive is a model (bench/predictive.py)

log = logging.getLogger("trainmedic.bench.repeat")


# --- configuration --------------------------------------------------------------------------------


@dataclass
class ScenarioConfig:
    name: str = "no_progress"
    seed: int = 11
    nodes: int = 8
    sizes: list[int] = field(default_factory=lambda: [4, 2])  # jobs started at once (first: the victim)
    step_s: list[float] = field(default_factory=lambda: [1.0, 1.2])
    first_step_extra_s: list[float] = field(default_factory=lambda: [3.0, 4.0])
    ckpt_every: int = 6
    ckpt_pause_s: list[float] = field(default_factory=lambda: [2.0, 3.0])
    fault_step: int = 10  # no_progress: the step at which the rank dies, in every attempt
    fault_node_index: int = 1  # no_progress / follows_job: which node of the job's allocation
    bad_node: str = "gpu0001"  # bad_node: the node that fails every job
    fault_after_s: float = 8.0  # bad_node / follows_job: run time before the Xid 79
    second_job_size: int = 4  # bad_node: job B
    nccl_timeout_s: float = 600.0
    requeue_delay_s: float = 1.0
    no_progress_limit: int = 3
    max_restarts: int = 10
    settle_s: float = 1.0
    collateral_wait_s: float = 5.0
    timeout_s: float = 420.0
    data_dir: str = str(REPO / "var" / "bench-repeat")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScenarioConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def scenario_config(name: str, limit: int, data_dir: Path, seed: int) -> ScenarioConfig:
    base = ScenarioConfig(name=name, no_progress_limit=limit, data_dir=str(data_dir), seed=seed)
    if name == "no_progress":
        # 8 nodes: the 4-node victim, a healthy 2-node job (control), 2 spare.
        return dataclasses.replace(base, timeout_s=90.0 + 50.0 * (limit + 1))
    if name == "bad_node":
        # 12 nodes: A (4, the bad node its first), a healthy 2-node job, 6 spare; B (4) comes later.
        return dataclasses.replace(base, nodes=12, sizes=[4, 2], timeout_s=150.0)
    if name == "follows_job":
        return dataclasses.replace(base, nodes=10, sizes=[4, 2], fault_node_index=2, timeout_s=150.0)
    raise SystemExit(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")


def policy_text(cfg: ScenarioConfig) -> str:
    """The default policy (streams/policies/default.yaml), autonomous, with the restart budget's
    plain count raised so that the no-progress rule is the one that stops the job (with the
    defaults, max_restarts 3 and no_progress_limit 3, both fire at the same fault)."""
    from streams.policy import DEFAULT_POLICY

    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data["mode"] = "autonomous"
    budget = dict(data.get("restart_budget") or {})
    budget.update(max_restarts=cfg.max_restarts, no_progress_limit=cfg.no_progress_limit)
    data["restart_budget"] = budget
    return yaml.safe_dump(data, sort_keys=False)


# --- the simulated cluster, with recurring faults -------------------------------------------------------


def _cluster_class() -> type:
    """RepeatCluster is defined lazily: sim.cluster pulls in the producers (and their deps)."""
    from sim import faults as F
    from sim.cluster import Injection, SimCluster, _Job

    class RepeatCluster(SimCluster):  # type: ignore[misc, valid-type]
        """SimCluster with a fixed job mix, jobs submitted later and faults armed by rule."""

        def __init__(self, config: Any, sizes: Sequence[int]) -> None:
            super().__init__(config)
            self._sizes = list(sizes)
            self._rules: list[Callable[[float], None]] = []
            self._later: list[tuple[Callable[[], bool], int, str]] = []
            self._rule_lock = threading.Lock()
            self.fired: set[tuple[str, int]] = set()
            self.submitted: dict[str, str] = {}  # logical name -> job id

        def _job_plan(self) -> list[int]:
            return list(self._sizes)

        # -- rules, run in the simulator's thread after each tick --------------------------------

        def add_rule(self, rule: Callable[[float], None]) -> None:
            with self._rule_lock:
                self._rules.append(rule)

        def submit_when(self, ready: Callable[[], bool], size: int, name: str) -> None:
            with self._rule_lock:
                self._later.append((ready, size, name))

        def step(self, now: float) -> None:
            super().step(now)
            with self._rule_lock:
                rules = list(self._rules)
                later = list(self._later)
            for rule in rules:
                rule(now)
            for item in later:
                ready, size, name = item
                if ready():
                    with self._rule_lock:
                        self._later.remove(item)
                    self.submit_job(size, name)

        def submit_job(self, size: int, name: str) -> str:
            import random

            i = len(self.jobs)
            jrng = random.Random(f"{self.cfg.seed}:job:{i}")
            job_id = self.sched.submit(name, size, self.cfg.partition)
            self.jobs[job_id] = _Job(
                job_id=job_id,
                name=name,
                size=size,
                rng=jrng,
                step_s=round(jrng.uniform(*self.cfg.step_s), 3),
                gbs=jrng.choice((256, 512, 1024, 2048)),
                total=500_000,
                ckpt_every=jrng.randint(*self.cfg.ckpt_every),
                ckpt_path=f"/lustre/ckpt/{name}",
                per_node=jrng.random() < self.cfg.per_node_progress_fraction,
            )
            self.submitted[name] = job_id
            self._drain_changes(time.time())  # its RUNNING, if it was placed at once
            return job_id

        def inject(self, kind: str, job_id: str, node: str, category: str, action: str, now: float) -> Any:
            spec = F.FAULTS[kind]
            job = self.jobs[job_id]
            inj = Injection(
                seq=len(self.injections),
                kind=kind,
                at_s=now - self.t0,
                job_id=job_id,
                node=node,
                rank=None,
                gpu=(len(self.injections) * 3) % GPUS_PER_NODE,
                category=category,
                expected_action=action,
                culprit=node if spec.culprit_scored and category != "hang" else None,
                job_nodes=job.nodes,
                job_gpus=job.size * GPUS_PER_NODE,
            )
            self._inject(inj, now)
            self.injections.append(inj)
            return inj

        # -- the three recurring faults ------------------------------------------------------------

        def arm_step_fault(self, job_id: str, step: int, node_index: int) -> None:
            """In every run of the job, the rank on its node_index-th node dies at `step`."""

            def rule(now: float) -> None:
                job = self.jobs[job_id]
                key = (job_id, job.run)
                if job.status != "running" or job.step < step or key in self.fired:
                    return
                self.fired.add(key)
                node = job.nodes[min(node_index, len(job.nodes) - 1)]
                # With NCCL's real watchdog the stall is longer than the hang detector's floor: a hang.
                self.inject("nccl_dead_rank", job_id, node, "hang", "requeue", now)

            self.add_rule(rule)

        def arm_bad_node(self, node: str, after_s: float) -> None:
            """Every job that has run `after_s` on `node` gets an Xid 79 there (a GPU off the bus)."""
            started: dict[tuple[str, int], float] = {}

            def rule(now: float) -> None:
                for job in list(self.jobs.values()):
                    if job.status != "running" or node not in job.nodes:
                        continue
                    key = (job.job_id, job.run)
                    t = started.setdefault(key, now)
                    if now - t >= after_s and key not in self.fired:
                        self.fired.add(key)
                        self.gpus[node].lost.clear()  # the GPU came back after a reset; it falls off again
                        self.inject("xid79", job.job_id, node, "gpu_hardware", "drain_and_requeue", now)

            self.add_rule(rule)

        def arm_following_fault(self, job_id: str, after_s: float, node_index: int) -> None:
            """In every run of the job, an Xid 79 on its node_index-th node after `after_s`."""
            started: dict[int, float] = {}

            def rule(now: float) -> None:
                job = self.jobs[job_id]
                if job.status != "running":
                    return
                t = started.setdefault(job.run, now)
                key = (job_id, job.run)
                if now - t >= after_s and key not in self.fired:
                    self.fired.add(key)
                    node = job.nodes[min(node_index, len(job.nodes) - 1)]
                    self.inject("xid79", job_id, node, "gpu_hardware", "drain_and_requeue", now)

            self.add_rule(rule)

    return RepeatCluster


# --- one scenario against the real stack ------------------------------------------------------------------


def _secs(col: str) -> str:
    return f"toUnixTimestamp64Milli({col}) / 1000.0"


def _query_audit(store: Any, job_ids: Sequence[str]) -> dict[str, Any]:
    from sinks.audit_queries import job_attempts

    q = store.query
    return {
        "incidents": q(
            f"SELECT incident_id, {_secs('event_time')} AS t, {_secs('first_signal_time')} AS first_signal, job_id, "
            "category, culprit_node, confidence, explanation, detection_latency_s "
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
        "attempts": {
            j: [
                {
                    k: (v.timestamp() if isinstance(v, dt.datetime) else v)
                    for k, v in r.items()
                    if k not in ("user", "job_name")
                }
                for r in job_attempts(store, j)
            ]
            for j in job_ids
        },
    }


def run_scenario(cfg: ScenarioConfig) -> dict[str, Any]:
    from bus.publish import Publisher
    from sim.cluster import ClusterConfig
    from trainmedic.stack.runtime import Stack, StackConfig

    root = Path(cfg.data_dir) / cfg.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    policy = root / "policy.yaml"
    policy.write_text(policy_text(cfg))
    cluster = _cluster_class()(
        ClusterConfig(
            nodes=cfg.nodes,
            seed=cfg.seed,
            transport="files",
            root=root / "cluster",
            spare_fraction=0.0,
            min_spare=0,
            step_s=(cfg.step_s[0], cfg.step_s[1]),
            first_step_extra_s=(cfg.first_step_extra_s[0], cfg.first_step_extra_s[1]),
            ckpt_every=(cfg.ckpt_every, cfg.ckpt_every),
            ckpt_pause_s=(cfg.ckpt_pause_s[0], cfg.ckpt_pause_s[1]),
            nccl_timeout_s=cfg.nccl_timeout_s,
            requeue_delay_s=cfg.requeue_delay_s,
            overflow_p=0.0,
        ),
        cfg.sizes,
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
        ),
        cluster.sched,
    ).start()
    startup_s = time.time() - t_stack
    store = stack.store
    assert store is not None
    publisher = Publisher(stack.bootstrap, "bench-repeat")
    outcome = "timeout"
    try:
        cluster.start(publisher)
        victim = "1001"  # the first job submitted
        if cfg.name == "no_progress":
            cluster.arm_step_fault(victim, cfg.fault_step, cfg.fault_node_index)
        elif cfg.name == "bad_node":
            cluster.arm_bad_node(cfg.bad_node, cfg.fault_after_s)
            a = cluster.jobs[victim]
            # B: the next job the scheduler starts once A's fault is over (here: A runs again).
            cluster.submit_when(lambda: a.run >= 1 and a.status == "running", cfg.second_job_size, "next-job-B")
        elif cfg.name == "follows_job":
            cluster.arm_following_fault(victim, cfg.fault_after_s, cfg.fault_node_index)
        log.info("%s: %d nodes, jobs %s", cfg.name, cfg.nodes, cluster.job_nodes())
        while True:
            time.sleep(1.0)
            stack.check_alive()
            elapsed = time.time() - cluster.t0
            done = _done(cfg, store, cluster, victim)
            if done:
                outcome = done
                time.sleep(3.0)  # the audit sink's last batches (job attempts, results)
                break
            if elapsed > cfg.timeout_s:
                log.warning("%s: timed out after %.0f s", cfg.name, elapsed)
                break
        end = time.time()
        job_ids = sorted(cluster.jobs, key=int)
        audit = _query_audit(store, job_ids)
    finally:
        with contextlib.suppress(Exception):
            cluster.stop()
        publisher.flush(10)
        publisher.close()
        stack.stop()
    return {
        "config": dataclasses.asdict(cfg),
        "outcome": outcome,
        "startup_s": round(startup_s, 2),
        "t0": cluster.t0,
        "end": end,
        "victim": victim,
        "jobs": {
            j.job_id: {"name": j.name, "size": j.size, "nodes": list(j.nodes), "status": j.status, "run": j.run}
            for j in cluster.jobs.values()
        },
        "submitted_later": dict(cluster.submitted),
        "injections": [i.as_dict() for i in cluster.injections],
        "sched_log": [dataclasses.asdict(r) for r in cluster.sched_log],
        "scheduler_calls": list(cluster.sched.calls),
        "nodes_drained": sorted(n.name for n in cluster.sched.list_nodes() if n.drained),
        "job_states": {j: dataclasses.asdict(cluster.sched.job_state(j)) for j in cluster.jobs},
        "audit": audit,
    }


def _done(cfg: ScenarioConfig, store: Any, cluster: Any, victim: str) -> str | None:
    decisions = store.query(
        "SELECT incident_id, action, kind FROM {db}.decisions FINAL WHERE job_id = {j:String}", {"j": victim}
    )
    results = {
        r["incident_id"]: r["status"]
        for r in store.query(
            "SELECT incident_id, status FROM {db}.action_results FINAL WHERE job_id = {j:String}", {"j": victim}
        )
    }
    faults = sum(1 for i in cluster.injections if i.job_id == victim and not i.skipped)
    if cfg.name == "no_progress":
        if any(d["action"] == "stop" and d["kind"] == "action" and results.get(d["incident_id"]) for d in decisions):
            return "stopped"
        if faults > cfg.no_progress_limit + 3:
            return "not stopped"
        return None
    if cfg.name == "bad_node":
        b = cluster.submitted.get("next-job-B")
        a = cluster.jobs[victim]
        if b is None or not results:
            return None
        jb = cluster.jobs[b]
        runs = [r for r in cluster.sched_log if r.kind == "job" and r.change == "RUNNING"]
        a_again = max((r.t for r in runs if r.job_id == victim), default=None)
        b_start = max((r.t for r in runs if r.job_id == b), default=None)
        margin = cfg.fault_after_s + 12.0
        now = time.time()
        if (
            a.status == "running"
            and jb.status == "running"
            and a_again is not None
            and b_start is not None
            and now - a_again > margin
            and now - b_start > margin
        ):
            return "settled"
        return None
    # follows_job: the second fault's decision.
    if len(decisions) >= 2 and all(d["incident_id"] in results or d["kind"] != "action" for d in decisions):
        return "decided"
    return None


# --- evaluation: trainmedic, from the audit and the scheduler's record --------------------------------------


def _first_incident(incidents: list[dict[str, Any]], job_id: str, t_from: float, t_to: float) -> dict[str, Any] | None:
    match = [r for r in incidents if r["job_id"] == job_id and t_from - 1.0 <= float(r["t"]) < t_to]
    return min(match, key=lambda r: float(r["t"])) if match else None


def evaluate_trainmedic(raw: dict[str, Any]) -> dict[str, Any]:
    """Per fault: incident, decision, action result, downtime (fault -> running again or stopped);
    per job: restarts, GPU-hours lost. All from the audit and the simulated scheduler's record."""
    audit = raw["audit"]
    incidents = audit["incidents"]
    decisions = {d["incident_id"]: d for d in audit["decisions"]}
    results: dict[str, list[dict[str, Any]]] = {}
    for r in audit["results"]:
        results.setdefault(r["incident_id"], []).append(r)
    sched = raw["sched_log"]
    injections = sorted((i for i in raw["injections"] if not i["skipped"]), key=lambda i: i["injected_at"])
    faults: list[dict[str, Any]] = []
    for n, inj in enumerate(injections):
        t_f = float(inj["injected_at"])
        later = [i for i in injections[n + 1 :] if i["job_id"] == inj["job_id"]]
        t_next = float(later[0]["injected_at"]) if later else float("inf")
        f: dict[str, Any] = {
            "job_id": inj["job_id"],
            "kind": inj["kind"],
            "node": inj["node"],
            "t_s": round(t_f - raw["t0"], 2),
            "run": inj["run_before"],
            "job_nodes": list(inj["job_nodes"]),
            "gpus": inj["job_gpus"],
        }
        inc = _first_incident(incidents, inj["job_id"], t_f, t_next)
        if inc is not None:
            f.update(
                incident_id=inc["incident_id"],
                category=inc["category"],
                culprit=inc["culprit_node"],
                detection_s=round(float(inc["t"]) - t_f, 2),
            )
            dec = decisions.get(inc["incident_id"])
            if dec is not None:
                f.update(action=dec["action"], decision_kind=dec["kind"], rule=dec["rule"], reason=dec["reason"])
            res = results.get(inc["incident_id"], [])
            if res:
                f.update(
                    result=[r["status"] for r in res],
                    action_latency_s=max(
                        (round(float(r["action_latency_s"]), 2) for r in res if r["action_latency_s"] is not None),
                        default=None,
                    ),
                    result_t=max(float(r["t"]) for r in res),
                    steps=[s for r in res for s in r["steps"]],
                )
        again = next(
            (
                s
                for s in sched
                if s["kind"] == "job"
                and s["job_id"] == inj["job_id"]
                and s["change"] == "RUNNING"
                and s["restarts"] > inj["run_before"]
                and s["t"] >= t_f
            ),
            None,
        )
        if again is not None and float(again["t"]) < t_next:
            f["running_again_s"] = round(float(again["t"]) - t_f, 2)
            f["running_again_on"] = list(again["nodes"])
            f["downtime_s"] = f["running_again_s"]
        elif f.get("action") == "stop" and f.get("decision_kind") == "action" and "result_t" in f:
            f["stopped_s"] = round(float(f["result_t"]) - t_f, 2)
            f["downtime_s"] = f["stopped_s"]
        faults.append(f)
    # Replays: a restarted attempt's run until its next fault, when the lineage says it made no progress.
    jobs: dict[str, Any] = {}
    for job_id, meta in raw["jobs"].items():
        fs = [f for f in faults if f["job_id"] == job_id]
        attempts = audit["attempts"].get(job_id, [])
        gpus = meta["size"] * GPUS_PER_NODE
        replay_s = 0.0
        replays: list[float] = []
        for a, b in zip(fs, fs[1:], strict=False):
            if a.get("running_again_s") is None:
                continue
            run_s = (b["t_s"] - a["t_s"]) - a["running_again_s"]
            replays.append(round(run_s, 2))
            replay_s += run_s
        downtime = sum(f.get("downtime_s") or 0.0 for f in fs)
        unresolved = [f for f in fs if f.get("downtime_s") is None]
        restarts = sum(
            1
            for f in fs
            if f.get("decision_kind") == "action"
            and f.get("action") in ("requeue", "drain_and_requeue")
            and f.get("result") == ["done"]
        )
        stop = next((f for f in fs if f.get("action") == "stop"), None)
        jobs[job_id] = {
            "name": meta["name"],
            "gpus": gpus,
            "faults": len(fs),
            "restarts": restarts,
            "restart_count_slurm": raw["job_states"][job_id]["restart_count"],
            "stopped": stop is not None and stop.get("decision_kind") == "action",
            "stop_recommended": stop is not None and stop.get("decision_kind") != "action",
            "stop_rule": stop.get("rule") if stop else None,
            "downtime_s": round(downtime, 2),
            "replay_without_progress_s": round(replay_s, 2),
            "replays_s": replays,
            "lost_s": round(downtime + replay_s, 2),
            "gpu_h": round(gpus * (downtime + replay_s) / 3600, 3),
            "unresolved_faults": len(unresolved),
            "ran_on": sorted({n for s in raw["sched_log"] if s["job_id"] == job_id for n in s["nodes"]}),
            "attempts": [
                {
                    k: a.get(k)
                    for k in (
                        "attempt",
                        "restart_count",
                        "start_step",
                        "max_step",
                        "start_checkpoint",
                        "new_checkpoint",
                        "progressed",
                        "cause_category",
                        "cause_node",
                        "excluded_nodes",
                        "end_reason",
                    )
                }
                for a in attempts
            ],
        }
    victim = raw["victim"]
    return {
        "outcome": raw["outcome"],
        "faults": faults,
        "jobs": jobs,
        "victim": victim,
        "nodes_drained": raw["nodes_drained"],
        "scheduler_calls": raw["scheduler_calls"],
        "detection_s": [f.get("detection_s") for f in faults],
        "action_latency_s": [f.get("action_latency_s") for f in faults],
        "startup_s": raw["startup_s"],
        "duration_s": round(raw["end"] - raw["t0"], 1),
    }


# --- the status quo: a stated model, replayed in virtual time --------------------------------------------------


@dataclass(frozen=True)
class StatusQuo:
    """No trainmedic. The per-fault figures are bench/pipeline.py's BaselineAssumptions."""

    nccl_watchdog_s: float = 600.0  # the waiting ranks abort then; the job's processes exit
    manual_response_s: float = 1800.0  # a person sees the failed job and restarts it
    silent_notice_s: float = 3600.0  # a person notices a job that makes no progress / a node that fails jobs
    requeue_delay_s: float = 1.0  # as the simulated scheduler (Slurm: cred_expire)
    max_batch_requeue: int = 0  # Slurm's cap on its own automatic requeues (0: none, as Slurm 22.05)
    horizon_s: float = 6 * 3600.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn))

    def run(self, until: float) -> None:
        while self._q and self._q[0][0] <= until:
            t, _, fn = heapq.heappop(self._q)
            self.now = t
            fn()


def status_quo_repeat(
    a: StatusQuo, restart: str, replay_s: float, gpus: int, stop_at_notice: bool = True
) -> dict[str, Any]:
    """A job whose every attempt fails `replay_s` after it starts, without progress (scenarios
    no_progress and follows_job). t = 0 is the first fault. Each fault: the ranks stall until
    NCCL's watchdog, the processes exit; then Slurm requeues it (`auto`: RequeueExit or a retry
    loop in the batch script, capped only by max_batch_requeue) or a person restarts it
    (`person`: manual_response_s later). A person notices the lack of progress silent_notice_s
    after the first fault and stops the job."""
    notice = a.silent_notice_s
    t = 0.0
    faults = [0.0]
    restarts = 0
    downtime = 0.0
    replay = 0.0
    stopped_at = notice
    why = f"a person notices no progress at {notice / 60:.0f} min and stops it"
    while True:
        exit_at = t + a.nccl_watchdog_s
        if exit_at >= notice:
            downtime += notice - t
            break
        if restart == "auto" and a.max_batch_requeue and restarts >= a.max_batch_requeue:
            stopped_at = exit_at
            downtime += exit_at - t
            why = f"Slurm holds it after MaxBatchRequeue={a.max_batch_requeue} automatic requeues"
            break
        wait = a.requeue_delay_s if restart == "auto" else a.manual_response_s + a.requeue_delay_s
        again = exit_at + wait
        if again >= notice:
            downtime += notice - t
            break
        restarts += 1
        downtime += again - t
        nxt = again + replay_s
        if nxt >= notice:
            replay += notice - again
            break
        replay += replay_s
        faults.append(nxt)
        t = nxt
    return {
        "restart": restart,
        "faults": len(faults),
        "restarts": restarts,
        "stopped_s": stopped_at,
        "why_stopped": why,
        "downtime_s": round(downtime, 1),
        "replay_without_progress_s": round(replay, 1),
        "lost_s": round(downtime + replay, 1),
        "gpu_h": round(gpus * (downtime + replay) / 3600, 2),
    }


def status_quo_bad_node(
    a: StatusQuo,
    restart: str,
    nodes: Sequence[str],
    jobs: Sequence[tuple[str, int]],
    bad: str,
    fault_after_s: float,
    second: tuple[str, int],
) -> dict[str, Any]:
    """The bad node stays in service until a person notices it (silent_notice_s after its first
    fault) and drains it. Every job that runs fault_after_s on it gets the Xid 79; its ranks stall
    until the watchdog; the job is restarted as in `status_quo_repeat`, without excluding any node
    (the pipeline baseline's plain restart). Job B (`second`) is submitted once the victim's first
    fault is over (its processes exited). Placement: the simulated scheduler's (first fit in node
    order), run in virtual time."""
    from sim.cluster import ClusterScheduler

    sched = ClusterScheduler(list(nodes), requeue_delay_s=0.0)
    clock = _Clock()
    logical: dict[str, str] = {}  # scheduler job id -> logical name
    gpus: dict[str, int] = {}
    fault_at: dict[str, list[float]] = {}
    back_at: dict[str, list[float]] = {}
    restarts: dict[str, int] = {}
    ran_on_bad: dict[str, int] = {}
    runs: dict[str, int] = {}  # scheduler id -> run counter
    state: dict[str, Any] = {"noticed": False, "second_submitted": False, "first_fault": None}

    early: dict[str, Any] = {}  # RUNNING emitted inside submit(), before the id was known

    def submit(name: str, size: int) -> None:
        jid = sched.submit(name, size)
        logical[jid] = name
        gpus[name] = size * GPUS_PER_NODE
        if jid in early:
            started(early.pop(jid))

    def on_change(kind: str, change: str, st: Any) -> None:
        if kind != "job" or change != "RUNNING":
            return
        if st.job_id not in logical:
            early[st.job_id] = st
            return
        started(st)

    def started(st: Any) -> None:
        jid = st.job_id
        name = logical[jid]
        runs[jid] = runs.get(jid, 0) + 1
        run = runs[jid]
        if fault_at.get(name) and len(back_at.setdefault(name, [])) < len(fault_at[name]):
            back_at[name].append(clock.now)
        if bad in st.nodes and not sched.node_state(bad).drained:
            ran_on_bad[name] = ran_on_bad.get(name, 0) + 1
            clock.at(clock.now + fault_after_s, lambda: fault(jid, run))

    def fault(jid: str, run: int) -> None:
        st = sched.job_state(jid)
        if st.state != "RUNNING" or runs.get(jid) != run:
            return
        name = logical[jid]
        fault_at.setdefault(name, []).append(clock.now)
        if state["first_fault"] is None:
            state["first_fault"] = clock.now
            clock.at(clock.now + a.silent_notice_s, notice)
        clock.at(clock.now + a.nccl_watchdog_s, lambda: exit_(jid, run))

    def exit_(jid: str, run: int) -> None:
        name = logical[jid]
        if restart == "auto" and not (a.max_batch_requeue and restarts.get(name, 0) >= a.max_batch_requeue):
            restarts[name] = restarts.get(name, 0) + 1

            def requeue() -> None:
                # Slurm's requeue delay (cred_expire) after the processes exit, counted as downtime.
                sched.requeue_job(jid, [])
                sched.tick()

            clock.at(clock.now + a.requeue_delay_s, requeue)
        else:
            sched.fail_job(jid, sched.job_state(jid).restart_count)
            if restart == "person":
                restarts[name] = restarts.get(name, 0) + 1
                size = gpus[name] // GPUS_PER_NODE
                clock.at(clock.now + a.manual_response_s + a.requeue_delay_s, lambda: submit(name, size))
        if not state["second_submitted"] and logical[jid] == jobs[0][0]:
            state["second_submitted"] = True
            submit(*second)
        sched.tick()

    def notice() -> None:
        state["noticed"] = True
        sched.drain_node(bad, "a person: this node fails every job")

    sched.subscribe(on_change)
    for name, size in jobs:
        submit(name, size)
    clock.run(a.horizon_s)
    out_jobs: dict[str, Any] = {}
    for name in [j[0] for j in jobs] + [second[0]]:
        fs = fault_at.get(name, [])
        bs = back_at.get(name, [])
        lost = sum((bs[i] if i < len(bs) else a.horizon_s) - f for i, f in enumerate(fs))
        out_jobs[name] = {
            "faults": len(fs),
            "restarts": restarts.get(name, 0),
            "ran_on_bad_node": ran_on_bad.get(name, 0),
            "downtime_s": round(lost, 1),
            "lost_s": round(lost, 1),
            "gpu_h": round(gpus.get(name, 0) * lost / 3600, 2),
        }
    return {
        "restart": restart,
        "jobs": out_jobs,
        "node_drained_at_s": a.silent_notice_s if state["noticed"] else None,
        "faults": sum(j["faults"] for j in out_jobs.values()),
        "restarts": sum(j["restarts"] for j in out_jobs.values()),
        "gpu_h": round(sum(j["gpu_h"] for j in out_jobs.values()), 2),
    }


# --- the scenarios' figures, side by side ------------------------------------------------------------------


def evaluate(raw: dict[str, Any], a: StatusQuo) -> dict[str, Any]:
    cfg = raw["config"]
    tm = evaluate_trainmedic(raw)
    a = dataclasses.replace(a, requeue_delay_s=cfg["requeue_delay_s"])
    victim = tm["jobs"][tm["victim"]]
    out: dict[str, Any] = {"name": cfg["name"], "config": cfg, "trainmedic": tm}
    if cfg["name"] in ("no_progress", "follows_job"):
        replays = victim["replays_s"]
        replay_s = statistics.fmean(replays) if replays else 0.0
        out["replay_s_used"] = round(replay_s, 2)
        out["status_quo"] = {r: status_quo_repeat(a, r, replay_s, victim["gpus"]) for r in ("auto", "person")}
        if cfg["name"] == "follows_job":
            out["trainmedic_completed"] = _follows_job_total(tm, a)
    else:
        names = {j: m["name"] for j, m in raw["jobs"].items()}
        first = [(names[j], m["size"]) for j, m in sorted(raw["jobs"].items(), key=lambda kv: int(kv[0]))]
        later = raw["submitted_later"]
        initial = [(n, s) for n, s in first if n not in later]
        second = next(((n, s) for n, s in first if n in later), ("next-job-B", cfg["second_job_size"]))
        nodes = [f"gpu{i:04d}" for i in range(1, cfg["nodes"] + 1)]
        out["status_quo"] = {
            r: status_quo_bad_node(a, r, nodes, initial, cfg["bad_node"], cfg["fault_after_s"], second)
            for r in ("auto", "person")
        }
    out["checks"] = checks(out)
    return out


def _follows_job_total(tm: dict[str, Any], a: StatusQuo) -> dict[str, Any]:
    """follows_job ends on a stop *recommendation* (policy never carries out a stop for a cause that
    follows the job: a person decides). What happens after it is not trainmedic's and is not waited
    for in the run; it is counted with the status quo's assumptions, per restart world:

    - `person` (failed jobs are restarted by people): the stalled ranks abort at NCCL's watchdog and
      the job ends there; the person who reads the escalation does not restart it;
    - `auto` (Slurm requeues failed jobs): the job comes back after the watchdog and fails again on
      yet another node (trainmedic recommends again) until the person acts on the escalation,
      manual_response_s after the recommendation."""
    victim = tm["jobs"][tm["victim"]]
    last = [f for f in tm["faults"] if f["job_id"] == tm["victim"]][-1]
    to_rec = float(last.get("detection_s") or 0.0)
    out: dict[str, Any] = {"measured_lost_s": victim["lost_s"], "to_recommendation_s": to_rec}
    for world, extra, why in (
        ("person", a.nccl_watchdog_s, f"the job ends at NCCL's watchdog ({a.nccl_watchdog_s:.0f} s)"),
        (
            "auto",
            to_rec + a.manual_response_s,
            f"Slurm requeues it; a person acts on the escalation {a.manual_response_s / 60:.0f} min after it",
        ),
    ):
        lost = victim["lost_s"] + extra
        out[world] = {
            "after_s": round(extra, 1),
            "why": why,
            "lost_s": round(lost, 1),
            "gpu_h": round(victim["gpus"] * lost / 3600, 2),
        }
    return out


def checks(ev: dict[str, Any]) -> dict[str, bool]:
    tm = ev["trainmedic"]
    victim = tm["jobs"][tm["victim"]]
    cfg = ev["config"]
    sq_best = min(s["gpu_h"] for s in ev["status_quo"].values())
    if cfg["name"] == "no_progress":
        limit = cfg["no_progress_limit"]
        return {
            "stopped": victim["stopped"],
            "stopped_by_no_progress_rule": bool(victim["stop_rule"]) and "no progress" in victim["stop_rule"],
            "restarts_equal_limit": victim["restarts"] == limit,
            "faults_equal_limit_plus_one": victim["faults"] == limit + 1,
            "lineage_no_progress_after_first": [a["progressed"] for a in victim["attempts"][1 : limit + 1]]
            == [False] * limit,
            "fewer_gpu_h_than_status_quo": victim["gpu_h"] < sq_best,
        }
    if cfg["name"] == "bad_node":
        later = [j for j, m in tm["jobs"].items() if m["name"] == "next-job-B"]
        b = tm["jobs"][later[0]] if later else None
        bad = cfg["bad_node"]
        return {
            "bad_node_drained": bad in tm["nodes_drained"],
            "one_fault_only": sum(m["faults"] for m in tm["jobs"].values()) == 1,
            "victim_not_back_on_bad_node": all(
                bad not in (f.get("running_again_on") or []) for f in tm["faults"] if f["job_id"] == tm["victim"]
            ),
            "second_job_ran_and_lost_nothing": b is not None
            and bad not in b["ran_on"]
            and b["faults"] == 0
            and bool(b["ran_on"]),
            "fewer_gpu_h_than_status_quo": sum(m["gpu_h"] for m in tm["jobs"].values()) < sq_best,
        }
    dec = [f for f in tm["faults"] if f["job_id"] == tm["victim"]]
    return {
        "first_drained_and_requeued": bool(dec) and dec[0].get("action") == "drain_and_requeue",
        "second_stop_recommended": len(dec) >= 2
        and dec[1].get("action") == "stop"
        and dec[1].get("decision_kind") == "recommendation",
        "one_node_drained": len(tm["nodes_drained"]) == 1,
        "fewer_gpu_h_than_status_quo": all(
            ev["trainmedic_completed"][w]["gpu_h"] < ev["status_quo"][w]["gpu_h"] for w in ("auto", "person")
        ),
    }


# --- report ------------------------------------------------------------------------------------------------


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _n(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _what_trainmedic_did(tm: dict[str, Any]) -> str:
    parts = []
    for f in tm["faults"]:
        if f["job_id"] != tm["victim"] and not f.get("action"):
            continue
        act = f.get("action", "nothing")
        kind = f.get("decision_kind", "")
        where = f" {f['culprit']}" if act in ("drain_and_requeue",) and f.get("culprit") else ""
        mark = "" if kind == "action" else " (recommended)"
        parts.append(f"{act}{where}{mark}")
    return ", ".join(parts) or "-"


def table(ev: dict[str, Any]) -> list[str]:
    tm = ev["trainmedic"]
    victim = tm["jobs"][tm["victim"]]
    sq = ev["status_quo"]
    name = ev["name"]
    head = _row(["", "with trainmedic (measured)", "status quo: Slurm requeues it", "status quo: a person restarts it"])
    sep = _row(["---"] * 4)
    lines = [head, sep]
    if name in ("no_progress", "follows_job"):
        tc = ev.get("trainmedic_completed")
        if tc:
            # Both restart worlds, in the order of the status-quo columns: Slurm requeues / a person restarts.
            ends = (
                f"stop recommended {_dur(tc['to_recommendation_s'])} after the 2nd fault (not carried out: a "
                f"person decides); then, not measured: {tc['auto']['why']} / {tc['person']['why']}"
            )
            end_t = f"{_dur(tc['auto']['lost_s'])} / {_dur(tc['person']['lost_s'])}"
            down = f"{_dur(victim['downtime_s'])} measured + {_dur(tc['auto']['after_s'])} / {_dur(tc['person']['after_s'])}"
            gpu_h = f"**{tc['auto']['gpu_h']:.2f} / {tc['person']['gpu_h']:.2f}**"
        else:
            ends = (
                f"stopped (held) by policy after {_n(victim['restarts'], 'restart')} without progress"
                if victim["stopped"]
                else "not stopped"
            )
            end_t = _dur(victim["lost_s"])
            down = _dur(victim["downtime_s"])
            gpu_h = f"**{victim['gpu_h']:.2f}**"
        lines += [
            _row(["faults", victim["faults"], sq["auto"]["faults"], sq["person"]["faults"]]),
            _row(["restarts", victim["restarts"], sq["auto"]["restarts"], sq["person"]["restarts"]]),
            _row(["how it ends", ends, sq["auto"]["why_stopped"], sq["person"]["why_stopped"]]),
            _row(
                [
                    "time from the first fault to the end",
                    end_t,
                    _dur(sq["auto"]["lost_s"]),
                    _dur(sq["person"]["lost_s"]),
                ]
            ),
            _row(
                [
                    "of which fault -> running again / stopped",
                    down,
                    _dur(sq["auto"]["downtime_s"]),
                    _dur(sq["person"]["downtime_s"]),
                ]
            ),
            _row(
                [
                    "of which restarted attempts replaying old steps",
                    _dur(victim["replay_without_progress_s"]),
                    _dur(sq["auto"]["replay_without_progress_s"]),
                    _dur(sq["person"]["replay_without_progress_s"]),
                ]
            ),
            _row(
                [
                    f"**GPU-hours lost** ({victim['gpus']} GPUs)"
                    + (" (where Slurm requeues / where a person restarts)" if tc else ""),
                    gpu_h,
                    f"**{sq['auto']['gpu_h']:.2f}**",
                    f"**{sq['person']['gpu_h']:.2f}**",
                ]
            ),
            _row(["what trainmedic did", _what_trainmedic_did(tm), "-", "-"]),
        ]
        if name == "follows_job":
            lines.append(_row(["nodes drained", ", ".join(tm["nodes_drained"]) or "none", "none", "none"]))
        return lines
    b_id = next((j for j, m in tm["jobs"].items() if m["name"] == "next-job-B"), None)
    a_tm = tm["jobs"][tm["victim"]]
    b_tm = tm["jobs"][b_id] if b_id else None
    a_name = a_tm["name"]
    rows = [
        ("faults", lambda j: j["faults"]),
        ("restarts", lambda j: j["restarts"]),
    ]
    for label, fn in rows:
        lines.append(
            _row(
                [
                    f"{label}: job A / job B",
                    f"{fn(a_tm)} / {fn(b_tm) if b_tm else '-'}",
                    f"{fn(sq['auto']['jobs'][a_name])} / {fn(sq['auto']['jobs']['next-job-B'])}",
                    f"{fn(sq['person']['jobs'][a_name])} / {fn(sq['person']['jobs']['next-job-B'])}",
                ]
            )
        )
    bad = ev["config"]["bad_node"]
    lines += [
        _row(
            [
                f"jobs placed on {bad} after its first fault",
                "none (drained)",
                f"A {max(0, sq['auto']['jobs'][a_name]['ran_on_bad_node'] - 1)}x, B "
                f"{sq['auto']['jobs']['next-job-B']['ran_on_bad_node']}x",
                f"A {max(0, sq['person']['jobs'][a_name]['ran_on_bad_node'] - 1)}x, B "
                f"{sq['person']['jobs']['next-job-B']['ran_on_bad_node']}x",
            ]
        ),
        _row(
            [
                f"{bad} drained",
                f"at the first fault, {_dur(tm['faults'][0].get('action_latency_s'))} after the incident",
                f"by a person at {_dur(sq['auto']['node_drained_at_s'])}",
                f"by a person at {_dur(sq['person']['node_drained_at_s'])}",
            ]
        ),
        _row(
            [
                "fault -> running again: A / B",
                f"{_dur(a_tm['downtime_s'])} / {_dur(b_tm['downtime_s']) if b_tm and b_tm['faults'] else 'no fault'}",
                f"{_dur(sq['auto']['jobs'][a_name]['lost_s'])} / {_dur(sq['auto']['jobs']['next-job-B']['lost_s'])}",
                f"{_dur(sq['person']['jobs'][a_name]['lost_s'])} / "
                f"{_dur(sq['person']['jobs']['next-job-B']['lost_s'])}",
            ]
        ),
        _row(
            [
                "**GPU-hours lost** (A and B: 32 GPUs each)",
                f"**{sum(m['gpu_h'] for m in tm['jobs'].values()):.2f}**",
                f"**{sq['auto']['gpu_h']:.2f}**",
                f"**{sq['person']['gpu_h']:.2f}**",
            ]
        ),
        _row(["what trainmedic did", _what_trainmedic_did(tm), "-", "-"]),
    ]
    return lines


SETUPS = {
    "no_progress": (
        "A 4-node job (32 GPUs) on an 8-node cluster with a healthy 2-node job beside it. In every attempt one "
        "rank's process dies silently at step {fault_step} (as a host OOM kill at a fixed batch would); the other "
        "ranks wait in NCCL. Checkpoints every {ckpt_every} steps: a restart resumes from step "
        "{resume} and dies at step {fault_step} again, never passing its best step."
    ),
    "bad_node": (
        "A 4-node job A on a 12-node cluster, its first node {bad_node} bad: every job that has run {after:.0f} s on "
        "it gets an Xid 79 there (GPU fallen off the bus). A 4-node job B is submitted once A's fault is over: "
        "the next job the scheduler starts."
    ),
    "follows_job": (
        "A 4-node job on a 10-node cluster; every attempt gets an Xid 79 {after:.0f} s after it starts, on its "
        "third node, whichever that is (the cause travels with the job: its configuration, say, not a node)."
    ),
}

TITLES = {
    "no_progress": "1. A job that keeps failing without progress",
    "bad_node": "2. A node that fails every job it gets",
    "follows_job": "3. The same cause following a job to other nodes",
    "predictive": "4. " + predictive.TITLE,
}


def assumptions(doc: dict[str, Any]) -> list[str]:
    a = doc["status_quo_assumptions"]
    cap = (
        f"MaxBatchRequeue={a['max_batch_requeue']}"
        if a["max_batch_requeue"]
        else "none (Slurm 22.05, the local cluster's, has no cap on RequeueExit requeues; later releases "
        "have MaxBatchRequeue, set with --max-batch-requeue)"
    )
    return [
        "Status quo, per fault (bench/pipeline.py's baseline): the job's ranks stall until NCCL's watchdog fires "
        f"({a['nccl_watchdog_s']:.0f} s) and its processes exit; then either Slurm requeues it "
        f"(RequeueExit or a retry loop in the batch script: {a['requeue_delay_s']:.0f} s later) or a person restarts it "
        f"({a['manual_response_s'] / 60:.0f} min later, pipeline's --manual-response-s). A plain restart excludes "
        "no node.",
        f"Status quo, repeats: nothing looks at progress; a person notices a job that makes no progress, or a node "
        f"that fails every job, {a['silent_notice_s'] / 60:.0f} min after the first fault (pipeline's "
        "--silent-notice-s) and stops the job or drains the node then. Slurm's own cap on restarts: "
        f"{cap}; a person's restarts are never capped.",
        "Status quo placement (bad_node): the simulated scheduler's first fit in node order, replayed in virtual "
        "time with the same jobs; the bad node is the first node of job A's allocation. Job B is submitted once "
        "A's first fault is over (with trainmedic: A runs again; without: A's processes exited).",
        "GPU-hours lost = the job's GPUs (nodes x 8) x (time from each fault to the job running again or stopped "
        "+ the time restarted attempts spent replaying steps below the best one, which the lineage marks as no "
        "progress). Time the job waits for a person counts, as in pipeline.md.",
        "With trainmedic every figure is read from the run: faults and their times from the simulator, incidents, "
        "decisions and action results from the audit (chDB), attempts and progress from job_attempts, running "
        "again from the scheduler's events. Policy: the default policy, autonomous, restart_budget "
        f"no_progress_limit {doc['limit']}, max_restarts raised to 10 (with the defaults, max_restarts 3 fires "
        "at the same fault as no_progress_limit 3).",
        "Time compression: trainmedic's latencies are real; the jobs' timings are simulated and compressed "
        "(steps of ~1.1 s, a 3-4 s start-up, checkpoints every 6 steps, a restarted attempt fails after replaying "
        "~4 steps, the bad node fails a job after 8 s). The status quo model uses the same replay and "
        "fault-after times, so only the mechanisms (watchdog, restart, notice) differ. Real replays take "
        "minutes: trainmedic's loss grows by (no_progress_limit) x the replay time, the status quo's is bounded "
        "by the notice time (see 'Sensitivity').",
        "NCCL's watchdog keeps its real 600 s in the simulator: a rank that dies silently is found by "
        "trainmedic's hang detector (30 s of silence), before the watchdog.",
    ]


def sensitivity(doc: dict[str, Any]) -> list[str]:
    """How the no_progress comparison moves with real replay times: a projection from the measured
    per-fault overhead, labelled as such."""
    ev = doc["scenarios"].get("no_progress")
    if not ev:
        return []
    tm = ev["trainmedic"]
    victim = tm["jobs"][tm["victim"]]
    n_f, n_r = victim["faults"], victim["restarts"]
    if n_r == 0:
        return []
    overhead = victim["downtime_s"]  # measured: detection + action + requeue, all faults
    a = StatusQuo(**doc["status_quo_assumptions"])
    lines = [
        _row(
            [
                "replay before each re-fault",
                "trainmedic (projected)",
                "status quo: Slurm requeues",
                "status quo: person",
            ]
        ),
        _row(["---"] * 4),
    ]
    for replay in (ev["replay_s_used"], 300.0, 900.0, 1800.0):
        tm_s = overhead + n_r * replay
        sq_a = status_quo_repeat(a, "auto", replay, victim["gpus"])
        sq_p = status_quo_repeat(a, "person", replay, victim["gpus"])
        lines.append(
            _row(
                [
                    _dur(replay) + (" (this run)" if replay == ev["replay_s_used"] else ""),
                    f"{victim['gpus'] * tm_s / 3600:.2f} GPU-h ({_n(n_r, 'restart')})",
                    f"{sq_a['gpu_h']:.2f} GPU-h ({_n(sq_a['restarts'], 'restart')})",
                    f"{sq_p['gpu_h']:.2f} GPU-h ({_n(sq_p['restarts'], 'restart')})",
                ]
            )
        )
    del n_f
    return lines


def render(doc: dict[str, Any], out: Path, prefix: str) -> Path:
    lines = [
        "# Repeat faults: GPU-hours lost with and without trainmedic",
        "",
        f"Measured {doc['measured_at']} on {doc['machine'].get('cpu', '?')} ({doc['machine'].get('cores', '?')} cores); "
        f"`{doc['command']}`. The real stack (embedded broker, Faust streams worker, executor, chDB audit) in "
        "autonomous mode against the simulated Slurm of `sim/`, job output through real files and the real "
        "job-log and kernel-log tailers. One run per scenario. Status quo: a model (assumptions below), replayed "
        "over the same job timings. Scenario 4 (predictive migration) is a model on a simulated fleet, not a run "
        "of the stack; its parameters and their sources are in its section.",
        "",
    ]
    for name, ev in doc["scenarios"].items():
        if name == predictive.NAME:
            lines += predictive.report(ev, TITLES[name])
            continue
        tm = ev["trainmedic"]
        c = ev["config"]
        setup = SETUPS[name].format(
            fault_step=c["fault_step"],
            ckpt_every=c["ckpt_every"],
            resume=c["fault_step"] - c["fault_step"] % c["ckpt_every"],
            bad_node=c["bad_node"],
            after=c["fault_after_s"],
        )
        lines += [f"## {TITLES[name]}", "", setup, ""]
        lines += table(ev)
        lines.append("")
        det = [d for d in tm["detection_s"] if d is not None]
        act = [d for d in tm["action_latency_s"] if d is not None]
        victim = tm["jobs"][tm["victim"]]
        lines.append(
            f"Run: {tm['duration_s']:.0f} s after a stack start of {tm['startup_s']:.0f} s; outcome `{tm['outcome']}`. "
            f"Detection (fault -> incident) {', '.join(f'{d:.1f}' for d in det) or '-'} s; action "
            f"(incident -> effect verified) {', '.join(f'{d:.2f}' for d in act) or '-'} s. Scheduler calls: "
            f"{'; '.join(tm['scheduler_calls']) or 'none'}."
        )
        if victim["attempts"]:
            lines += ["", "Attempt lineage of the job (audit `job_attempts`):", ""]
            lines.append(_row(["attempt", "restarts", "start step", "max step", "progressed", "ended by", "excluded"]))
            lines.append(_row(["---"] * 7))
            for at in victim["attempts"]:
                lines.append(
                    _row(
                        [
                            at["attempt"],
                            at["restart_count"],
                            at["start_step"] if at["start_step"] is not None else "-",
                            at["max_step"] if at["max_step"] is not None else "-",
                            {True: "yes", False: "no", None: "-"}[at["progressed"]],
                            (at["cause_category"] or "-") + (f" on {at['cause_node']}" if at["cause_node"] else ""),
                            ", ".join(at["excluded_nodes"] or []) or "-",
                        ]
                    )
                )
        rules = [f for f in tm["faults"] if f["job_id"] == tm["victim"] and f.get("rule")]
        if rules:
            lines += ["", "Decisions:", ""]
            for f in rules:
                lines.append(f"- {f['action']} ({f['decision_kind']}): `{f['rule']}`")
        failed = [k for k, v in ev["checks"].items() if not v]
        lines += ["", "Checks: " + ("all passed" if not failed else "FAILED: " + ", ".join(failed)) + "."]
        if name == "follows_job":
            tc = ev["trainmedic_completed"]
            lines += [
                "",
                f"The run ends at the stop recommendation ({_dur(tc['measured_lost_s'] + tc['to_recommendation_s'])} "
                "after the first fault, measured). Policy never carries out a stop for a cause that follows the job "
                "(a person decides), so what comes after is counted with the status quo's assumptions and is not "
                f"measured: where people restart failed jobs, {tc['person']['why']}; where Slurm requeues failed "
                f"jobs, {tc['auto']['why']}. The drained node was healthy (the cause travels with the job); it "
                "returns through `trainmedic nodes resume` after its health check.",
            ]
        lines.append("")
    sens = sensitivity(doc)
    if sens:
        lines += [
            "## Sensitivity: real replay times (scenario 1, projected)",
            "",
            "Not measured: trainmedic's measured per-fault time (detection + action + requeue, all faults) plus "
            "`restarts x replay`, against the status quo model at the same replay. The no-progress limit costs "
            "trainmedic one replay per restart; the status quo pays until the notice time.",
            "",
            *sens,
            "",
        ]
    lines += ["## Assumptions", ""]
    lines += [f"- {x}" for x in assumptions(doc)]
    lines += [
        "",
        "## Reproduce",
        "",
        "`.venv/bin/python -m bench.repeat_faults` (all three scenarios, about 6 minutes on 2 cores; "
        "`--scenarios`, `--limit`, `--silent-notice-s`, `--manual-response-s`, `--max-batch-requeue`, `--out`; "
        "for scenario 4 `--lead-times`, `--precisions`, `--predictive-jobs`, `--restart-s`, `--drain-hold-h`, "
        "`--recall`; `--scenarios predictive` alone takes about a second). "
        "Each scenario runs in its own process with its own stack under `--data-dir` (default "
        "`var/bench-repeat/`, where `raw.json` keeps the run's records). "
        "`tests/e2e/test_repeat_faults_bench.py` runs scenario 1 with `--limit 1` and checks the outcome.",
        "",
    ]
    path = out / f"{prefix}.md"
    path.write_text("\n".join(lines))
    return path


# --- orchestration ---------------------------------------------------------------------------------------------


def run_child(cfg: ScenarioConfig, out_dir: Path) -> dict[str, Any]:
    """Each scenario in its own process: its own stack, broker and chDB folder."""
    cfg_path = out_dir / f".{cfg.name}.repeat.config.json"
    raw_path = out_dir / f".{cfg.name}.repeat.raw.json"
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    raw_path.unlink(missing_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.repeat_faults", "--child", str(cfg_path), "--child-out", str(raw_path)],
            cwd=REPO,
            timeout=cfg.timeout_s + 180,
            check=False,
        )
        if proc.returncode != 0 or not raw_path.exists():
            raise RuntimeError(f"scenario {cfg.name} failed (exit {proc.returncode}); see the output above")
        raw: dict[str, Any] = orjson.loads(raw_path.read_bytes())
        # Kept beside the stack's data, so that --reuse-raw can re-evaluate without a rerun.
        (Path(cfg.data_dir) / cfg.name / "raw.json").write_bytes(raw_path.read_bytes())
    finally:
        cfg_path.unlink(missing_ok=True)
        raw_path.unlink(missing_ok=True)
    return raw


def default_limit() -> int:
    from streams.policy import load_policy

    return load_policy().restart_budget.no_progress_limit


def run_bench(a: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    from bench import figures, results
    from bench.machine import machine

    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    limit = a.limit if a.limit is not None else default_limit()
    sq = StatusQuo(
        nccl_watchdog_s=a.nccl_watchdog_s,
        manual_response_s=a.manual_response_s,
        silent_notice_s=a.silent_notice_s,
        max_batch_requeue=a.max_batch_requeue,
    )
    names = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    doc: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(
            ["python -m bench.repeat_faults", *(x for x in sys.argv[1:] if x != "--reuse-raw")]
        ).strip(),
        "limit": limit,
        "status_quo_assumptions": dataclasses.asdict(sq),
        "scenarios": {},
    }
    for name in names:
        if name == predictive.NAME:
            t = time.time()
            ev = predictive.run(predictive_config(a))
            doc["scenarios"][name] = ev
            failed = [k for k, v in ev["checks"].items() if not v]
            verdict = f"FAILED {failed}" if failed else "checks passed"
            say(f"[repeat] {name} (a model) done in {time.time() - t:.1f} s: {verdict}")
            continue
        cfg = scenario_config(name, limit, a.data_dir, a.seed)
        say(f"[repeat] {name}: {cfg.nodes} nodes, jobs of {cfg.sizes} nodes; no_progress_limit {limit}")
        t = time.time()
        saved = Path(cfg.data_dir) / cfg.name / "raw.json"
        raw = orjson.loads(saved.read_bytes()) if a.reuse_raw and saved.exists() else run_child(cfg, out)
        ev = evaluate(raw, sq)
        doc["scenarios"][name] = ev
        if a.reuse_raw:  # re-evaluated: the run's own time
            t0 = dt.datetime.fromtimestamp(raw["t0"], dt.UTC).isoformat(timespec="seconds")
            doc["measured_at"] = min(doc["measured_at"], t0)
        failed = [k for k, v in ev["checks"].items() if not v]
        say(
            f"[repeat] {name} done in {time.time() - t:.0f} s: {'checks passed' if not failed else 'FAILED ' + str(failed)}"
        )
    json_path = out / f"{a.prefix}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = render(doc, out, a.prefix)
    common = results.record(
        "repeat_faults",
        figures.repeat_faults(doc),
        root=out,
        started=doc["measured_at"],
        machine=doc["machine"],
        details=doc,
        variant=results.variant_name(a.prefix, "repeat-faults"),
        report=md,
    )
    for name, ev in doc["scenarios"].items():
        say("")
        say(TITLES[name])
        for line in predictive.table(ev) if name == predictive.NAME else table(ev):
            say(line)
    say(f"\n[repeat] wrote {json_path}, {md} and {common}")
    return doc


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from e


def predictive_config(a: argparse.Namespace) -> predictive.PredictiveConfig:
    base = predictive.PredictiveConfig(seed=a.seed)
    return dataclasses.replace(
        base,
        jobs=a.predictive_jobs if a.predictive_jobs is not None else base.jobs,
        lead_times_s=a.lead_times or base.lead_times_s,
        precisions=a.precisions or base.precisions,
        restart_s=a.restart_s if a.restart_s is not None else base.restart_s,
        drain_hold_h=a.drain_hold_h if a.drain_hold_h is not None else base.drain_hold_h,
        recall=a.recall if a.recall is not None else base.recall,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.repeat_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument(
        "--limit", type=int, default=None, help="restart_budget.no_progress_limit (default: the default policy's)"
    )
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--manual-response-s", type=float, default=1800.0, help="status quo: a person's restart")
    p.add_argument("--silent-notice-s", type=float, default=3600.0, help="status quo: when a person notices")
    p.add_argument("--nccl-watchdog-s", type=float, default=600.0, help="status quo: NCCL's watchdog")
    p.add_argument(
        "--max-batch-requeue", type=int, default=0, help="status quo: Slurm's cap on automatic requeues (0: none)"
    )
    p.add_argument(
        "--lead-times", type=_floats, default=None, help="predictive: lead times in seconds, comma-separated"
    )
    p.add_argument("--precisions", type=_floats, default=None, help="predictive: precisions in (0, 1], comma-separated")
    p.add_argument("--predictive-jobs", type=int, default=None, help="predictive: job slots in the fleet")
    p.add_argument("--restart-s", type=float, default=None, help="predictive: one restart of a job, seconds")
    p.add_argument("--drain-hold-h", type=float, default=None, help="predictive: a falsely warned node's drain")
    p.add_argument("--recall", type=float, default=None, help="predictive: share of faults warned")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--prefix", default="repeat-faults")
    p.add_argument("--data-dir", type=Path, default=REPO / "var" / "bench-repeat")
    p.add_argument("--reuse-raw", action="store_true", help=argparse.SUPPRESS)  # re-evaluate the last run
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = parse_args(argv)
    if a.child:
        logging.getLogger("trainmedic.bench").setLevel(logging.INFO)
        raw = run_scenario(ScenarioConfig.from_dict(json.loads(a.child.read_text())))
        a.child_out.write_bytes(orjson.dumps(raw, default=str))
        return 0
    for s in a.scenarios.split(","):
        if s.strip() and s.strip() not in SCENARIOS:
            raise SystemExit(f"--scenarios: unknown {s.strip()!r} (known: {', '.join(SCENARIOS)})")
    if a.limit is not None and a.limit < 1:
        raise SystemExit("--limit: at least 1")
    if any(not 0.0 < x <= 1.0 for x in a.precisions or ()):
        raise SystemExit("--precisions: each in (0, 1]")
    if any(x < 0.0 for x in a.lead_times or ()):
        raise SystemExit("--lead-times: each at least 0")
    if a.recall is not None and not 0.0 <= a.recall <= 1.0:
        raise SystemExit("--recall: in [0, 1]")
    if a.predictive_jobs is not None and a.predictive_jobs < 1:
        raise SystemExit("--predictive-jobs: at least 1")
    doc = run_bench(a)
    failed = {n: [k for k, v in ev["checks"].items() if not v] for n, ev in doc["scenarios"].items()}
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
