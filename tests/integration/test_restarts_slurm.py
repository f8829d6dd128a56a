"""Recovery past the first restart on the REAL Slurm 22.05 and 24.11 clusters (#20 items 1 and 2).

A job on the real cluster reports progress (Megatron iteration lines, parsed by the real job-log
producer) and then fails with NCCL watchdog timeouts on every rank (interconnect, no single node:
policy's answer is a requeue). The Slurm producer runs throughout, so the streams worker sees each
requeue as Slurm reports it. The first run makes progress; each restart after it does not (it
replays iterations below the best one). With `no_progress_limit: 2` the job is requeued twice and
then stopped (held for a person), not restarted a third time; the audit holds the attempt lineage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.slurm import SlurmProducer
from sinks.audit_queries import job_attempts
from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, wait_for
from tests.integration.scenario import LOGS, NODES, RANKS_PER_NODE, policy_file, start_stack, watchdog_line
from tests.integration.test_slurm_coexistence import _clean, _sh
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _iteration_line(step: int) -> str:
    # A Megatron-LM iteration line of tests/fixtures/logs/healthy_training.log, at another step.
    first = next(x for x in (LOGS / "healthy_training.log").read_text().splitlines() if "elapsed time per iter" in x)
    head, _, tail = first.partition("/")
    return f" iteration {step:>8}/" + tail if "iteration" in head else first


def _attempt(bootstrap: str, root: Path, job: str, n: int, steps: range) -> None:
    """One attempt's log: its iterations, then watchdog timeouts on every rank (new file, new lines)."""
    paths = {}
    for i, node in enumerate(NODES):
        path = root / f"attempt{n}" / f"{node}.out"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [_iteration_line(s) for s in steps] if i == 0 else []
        lines += [watchdog_line(r) for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE)]
        path.write_text("".join(x + "\n" for x in lines))
        paths[node] = path
    pub = Publisher(bootstrap, f"test-attempt-{n}")
    try:
        JobLogProducer(
            pub,
            job,
            list(paths.values()),
            JobLayout(tuple(NODES), RANKS_PER_NODE),
            partition="gpu",
            node_of_path={p: n for n, p in paths.items()},
        ).poll_once()
        assert pub.flush(10) == 0
    finally:
        pub.close()


def _policy(tmp: Path) -> Path:
    return policy_file(
        tmp,
        mode="autonomous",
        # A watchdog timeout with no single culprit is an interconnect incident of confidence 0.4.
        min_confidence=0.3,
        restart_budget={"max_restarts": 10, "window_h": 6, "no_progress_limit": 2, "stop": "hold"},
    )


@pytest.mark.slow(
    reason="three attempts of a job on a real Slurm, each requeue waiting out Slurm's own cred_expire (~6 s) and "
    "the job's restart, on each Slurm version"
)
def test_restarts_without_progress_stop_at_the_limit_and_the_lineage_is_audited(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    publisher = Publisher(broker.bootstrap, "test-slurm-producer")
    producer = SlurmProducer(publisher, runner=cluster.runner(), interval_s=1.0, state_path=tmp_path / "p.json")
    producer.poll_once()  # cold start: the baseline
    stop = threading.Event()

    def follow_slurm() -> None:
        while not stop.wait(0.5):
            producer.poll_once()

    follower = threading.Thread(target=follow_slurm, daemon=True)
    follower.start()
    stack = start_stack(broker.bootstrap, chdb_url, database, backend, tmp_path / "stack", policy=_policy(tmp_path))
    try:
        store = stack.store
        assert store is not None
        out = _sh(
            cluster,
            "sbatch",
            "--parsable",
            "--nodes=4",
            "--requeue",
            "--job-name=train",
            "--output=/dev/null",
            "--wrap",
            "sleep 600",
        )
        job = out.strip().split(";")[0]

        def decisions() -> list[dict[str, object]]:
            return store.query(
                "SELECT incident_id, action, kind, rule FROM {db}.decisions FINAL WHERE job_id = {j:String} "
                "ORDER BY event_time",
                {"j": job},
            )

        # Attempt 1 reaches iteration 300; attempts 2 and 3 replay up to 250: no progress.
        for n, steps in ((1, range(100, 301, 100)), (2, range(150, 251, 50)), (3, range(200, 251, 50))):

            def running(restarts: int = n - 1) -> bool:
                s = backend.job_state(job)
                return s.state == "RUNNING" and s.restart_count == restarts

            def decided(count: int = n) -> bool:
                return len(decisions()) >= count

            wait_for(f"job {job} RUNNING (restart {n - 1})", running, timeout=90)
            time.sleep(3)  # the producer's RUNNING event reaches the worker before the new fault
            _attempt(broker.bootstrap, tmp_path, job, n, steps)
            wait_for(f"decision {n}", decided, timeout=90)
        made = decisions()
        assert [(d["action"], d["kind"]) for d in made] == [
            ("requeue", "action"),
            ("requeue", "action"),
            ("stop", "action"),
        ], made
        assert "no progress: 2 restarts in a row without a higher step or a new checkpoint, limit 2" in str(
            made[2]["rule"]
        )
        wait_for(f"job {job} held", lambda: backend.job_state(job).held, timeout=90)
        time.sleep(3)  # nothing restarts it again
        after = backend.job_state(job)
        # Held by a held requeue (a running job cannot be held in place): Slurm counts it as a
        # restart, and the lineage as the attempt that waits for a person.
        assert (after.state, after.held, after.restart_count) == ("PENDING", True, 3)

        def lineage() -> list[dict[str, object]] | None:
            rows = job_attempts(store, job)
            return rows if len(rows) == 4 and rows[2]["cause_incident_id"] else None

        rows = wait_for("the attempts in the audit", lineage, timeout=60)
        assert len({r["lineage_id"] for r in rows}) == 1
        assert [(r["attempt"], r["restart_count"], r["progressed"]) for r in rows] == [
            (1, 0, True),
            (2, 1, False),
            (3, 2, False),
            (4, 3, None),
        ]
        assert [r["cause_incident_id"] for r in rows[:3]] == [d["incident_id"] for d in made]
        assert rows[3]["cause_incident_id"] is None and rows[3]["ended_at"] is None
        assert (rows[1]["start_step"], rows[1]["max_step"]) == (300, 250)
    finally:
        stack.stop()
        stop.set()
        follower.join(10)
        publisher.close()
