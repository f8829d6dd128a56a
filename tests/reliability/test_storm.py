"""Alert storm: 10,000 anomalies inside one minute across a 320-node cluster, through a real
Stack (embedded broker, Faust worker, executor, audit sink on chDB, operator API + console).

What must hold: every anomaly lands in the audit once, the storm folds into one incident per
job, the executor's blast radius caps the drains and says so (guardrail trips) while every job
is still requeued off its culprit node (issue 40), the lag is visible on the worker's metrics, and
the console keeps answering while it all happens.

Its size is the reliability run's figure: `python -m bench.reliability` runs 10,000 anomalies over
64 jobs (TRAINMEDIC_STORM_ANOMALIES, TRAINMEDIC_STORM_JOBS). The test suite checks the same
guarantees on 1,000 over 16 jobs (issue 37: a benchmark's plumbing on the smallest input that
exercises it): still more jobs than the blast radius allows drains, and many anomalies per job."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from schemas.topics import ANOMALIES
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import wait_for
from tests.reliability.harness import anomaly, produce, report_row
from trainmedic.stack.broker import EmbeddedBroker, free_port
from trainmedic.stack.runtime import Stack, StackConfig

NODES = [f"n{i:03d}" for i in range(320)]
JOBS = int(os.environ.get("TRAINMEDIC_STORM_JOBS", "16"))  # at most 80 (4 nodes each)
NODES_PER_JOB = 4
ANOMALIES_TOTAL = int(os.environ.get("TRAINMEDIC_STORM_ANOMALIES", "1000"))
MAX_DRAINS = 2  # streams/policies/default.yaml: guardrails.max_drains_per_window
AGE = re.compile(r'^trainmedic_consumer_record_age_seconds\{component="attribute",topic="anomalies"\} (\S+)$', re.M)


@dataclass
class Watch:
    """Polls the console and the worker's metrics from another thread during the storm."""

    api: str
    token: str
    metrics: str
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    ages: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            for path in ("/api/console/status", "/api/incidents", "/api/health"):
                req = urllib.request.Request(self.api + path, headers={"Authorization": f"Bearer {self.token}"})
                try:
                    with urllib.request.urlopen(req, timeout=10) as resp:
                        resp.read()
                        self.answered += 1
                except Exception as exc:  # a refused, failed or timed-out request is what we look for
                    self.failures.append(f"{path}: {exc}")
            try:
                with urllib.request.urlopen(self.metrics, timeout=10) as resp:
                    self.ages += [float(v) for v in AGE.findall(resp.read().decode())]
            except OSError as exc:
                self.failures.append(f"worker metrics: {exc}")
            self.stop.wait(0.25)


def _count(store: AuditStore, sql: str) -> int:
    return int(store.query(sql)[0]["n"])


def test_ten_thousand_anomalies_in_a_minute(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    sched = SimulatedScheduler(NODES, requeue_delay_s=0.5)
    jobs = [sched.submit(f"train-{j}", NODES_PER_JOB) for j in range(JOBS)]
    placed = {job: list(sched.job_state(job).nodes) for job in jobs}
    metrics_port = free_port()
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode="autonomous",
            api_port=0,
            worker_metrics_port=metrics_port,
        ),
        sched,
    ).start()
    try:
        store, api = stack.store, stack.api
        assert store is not None and api is not None
        watch = Watch(api.url, stack.config.token_file.read_text().strip(), f"http://127.0.0.1:{metrics_port}/metrics")
        watcher = threading.Thread(target=watch.run, daemon=True)
        watcher.start()

        # Event times spread over one minute; published as one burst, the harder case.
        start = time.time() - 60
        events = []
        for i in range(ANOMALIES_TOTAL):
            job = jobs[i % JOBS]
            node = placed[job][(i // JOBS) % NODES_PER_JOB]
            t = start + 60 * i / ANOMALIES_TOTAL
            events.append((ANOMALIES.name, anomaly(i, job, node, job_nodes=placed[job], t=t)))
        produced = produce(broker.bootstrap, events, timeout=120)
        assert produced.delivered == ANOMALIES_TOTAL

        wait_for(
            "every anomaly in the audit",
            lambda: _count(store, "SELECT count() AS n FROM {db}.anomalies FINAL") == ANOMALIES_TOTAL,
            timeout=300,
            interval=1.0,
        )
        wait_for(
            "an action result for every job, and the trips of those whose drain was refused",
            lambda: (
                _count(store, "SELECT count() AS n FROM {db}.action_results FINAL") >= JOBS
                and _count(store, "SELECT uniqExact(action_id) AS n FROM {db}.guardrail_trips FINAL")
                >= JOBS - MAX_DRAINS
            ),
            timeout=300,
            interval=1.0,
        )
        watch.stop.set()
        watcher.join(30)
        stack.check_alive()

        assert _count(store, "SELECT count() AS n FROM {db}.anomalies") == ANOMALIES_TOTAL  # no duplicates either
        incidents = store.query("SELECT job_id, count() AS n FROM {db}.incidents FINAL GROUP BY job_id")
        assert sorted(r["job_id"] for r in incidents) == sorted(jobs)
        assert all(r["n"] == 1 for r in incidents), "the storm folded into one incident per job"
        drains = [c for c in sched.calls if c.startswith("drain")]
        assert len(drains) == MAX_DRAINS, sched.calls
        trips = store.query("SELECT guardrail, count() AS n FROM {db}.guardrail_trips FINAL GROUP BY guardrail")
        assert {r["guardrail"]: r["n"] for r in trips} == {"blast_radius": JOBS - MAX_DRAINS}
        # A refused drain still requeues its job with the culprit node excluded: every job leaves it.
        requeues = [c for c in sched.calls if c.startswith("requeue")]
        assert len(requeues) == JOBS, sched.calls
        results = store.query("SELECT status, steps FROM {db}.action_results FINAL")
        assert sorted(r["status"] for r in results) == ["done"] * JOBS, results
        refused = [r for r in results if r["steps"][0].startswith("drain ") and "refused by guardrail" in r["steps"][0]]
        assert len(refused) == JOBS - MAX_DRAINS
        assert _count(store, "SELECT count() AS n FROM {db}.dead_letters") == 0

        print(
            f"storm: {watch.answered} console answers, lag gauge max {max(watch.ages, default=0):.1f} s, "
            f"{len(drains)} drains, {JOBS - len(drains)} guardrail trips, {len(requeues)} requeues"
        )
        assert watch.failures == [], watch.failures[:5]
        assert watch.answered >= 3, "the console was polled during the storm"
        assert watch.ages, "the worker's lag gauge was exposed during the storm"
        report_row(
            f"alert storm: {ANOMALIES_TOTAL} anomalies in a minute, {JOBS} jobs",
            sent=ANOMALIES_TOTAL,
            landed=_count(store, "SELECT count() AS n FROM {db}.anomalies FINAL"),
            duplicates=_count(store, "SELECT count() - uniqExact(event_id) AS n FROM {db}.anomalies"),
            actions_expected=MAX_DRAINS + JOBS,  # the drains the cap allows + every job's requeue
            actions_taken=len(sched.calls),
            note=f"{JOBS} incidents, {JOBS - MAX_DRAINS} blast-radius trips (each job still requeued off its "
            f"node); console answered {watch.answered} "
            f"requests, 0 failed; lag gauge max {max(watch.ages):.1f} s",
        )
    finally:
        stack.stop()
