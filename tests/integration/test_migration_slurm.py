"""Checkpoint-aligned migration on the REAL Slurm 22.05 and 24.11 clusters and the real broker (issue 44,
deliverables 2 and 5).

A job runs on gpu03 and has saved checkpoint 400 (a Megatron line, read by the real job-log
producer). gpu03's GPU 2 then reports a row remap pending (the real NVML collector over the fake
pynvml module): a GPU reset is required. Under an autonomous policy with prediction enabled, the
running stack drains gpu03 at once with a reason naming the predicted incident, the job running on;
when the job logs its next completed save (checkpoint 600) it is requeued excluding gpu03. Other
cases: a job that never checkpoints past 400 falls back at the bound (gpu03 stays drained, the job
is not requeued); monitor mode only recommends; an operator's cancel resumes gpu03 and the job is
never requeued; a pending migration survives a restart of the streams worker and of the executor;
predictive drains stop at their own cap while a reactive drain (Xid 79) still goes through.

Only this test's jobs and nodes are touched: other tests use the clusters too (their file lock
runs one test at a time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus.publish import Publisher
from producers.gpu_nvml import NvmlCollector
from producers.joblogs import JobLayout, JobLogProducer
from producers.kernel import KernelLogProducer
from producers.slurm import SlurmProducer
from schemas.codec import decode
from schemas.events import Action, GpuSampleBatch
from schemas.ids import stable_id
from schemas.topics import ACTIONS, GPU_SAMPLES, GPU_SAMPLES_BY_JOB
from sinks.audit import AuditStore
from sinks.audit_queries import job_migrations, job_timeline
from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import Cluster, read_topic, wait_for
from tests.fakes.fake_pynvml import FakeNvml
from tests.integration.scenario import policy_file, start_stack, xid79_line
from tests.integration.test_slurm_coexistence import _clean, _sh
from trainmedic.cli.audit import migration_line
from trainmedic.ops.migrations import cancel_migration
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

pytestmark = pytest.mark.slurm
NODE = "gpu03"
SAVED = " successfully saved checkpoint from iteration {step:>8} to /ckpt/run1"
# Megatron's async save prints this when it schedules the write, before the data is durable.
SCHEDULED = " saving checkpoint at iteration {step:>8} to /ckpt/run1 in torch_dist format"


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _clean(slurm_any)
    yield slurm_any
    _clean(slurm_any)


def _policy(tmp: Path, mode: str = "autonomous", wait_s: float = 300.0, **guardrails: Any) -> Path:
    rails = {
        "kill_switch": False,
        "max_drains_per_window": 2,
        "max_predictive_drains_per_window": 1,
        "drain_window_s": 3600,
        "max_drain_fraction": 1.0,
        "node_cooldown_s": 600,
        **guardrails,
    }
    prediction = {"enabled": True, "checkpoint_wait_s": wait_s, "without_checkpoints": "drain"}
    return policy_file(tmp, mode=mode, prediction=prediction, guardrails=rails)


class Rig:
    """The stack, the Slurm producer, and what the job and gpu03 write."""

    def __init__(self, broker: EmbeddedBroker, cluster: Cluster, tmp: Path) -> None:
        self.cluster, self.tmp, self.bootstrap = cluster, tmp, broker.bootstrap
        self.backend = SlurmCliBackend(cluster.runner())
        self.pub = Publisher(broker.bootstrap, "test-migration")
        self.slurm = SlurmProducer(self.pub, runner=cluster.runner(), interval_s=1.0, state_path=tmp / "p.json")
        self.slurm.poll_once()  # cold start: the baseline
        self.fake = FakeNvml()
        self.nvml = NvmlCollector(self.fake)
        self.logs: dict[str, tuple[Path, JobLogProducer]] = {}
        self.stack: Stack | None = None

    def start(self, chdb_url: str, database: str, policy: Path, api: bool = False) -> AuditStore:
        if api:
            config = StackConfig(
                data_dir=self.tmp / "stack", bootstrap=self.bootstrap, clickhouse=chdb_url, database=database,
                policy=policy, settle_s=1.0, collateral_wait_s=3.0, api_port=0,
            )  # fmt: skip
            self.stack = Stack(config, self.backend).start()
        else:
            self.stack = start_stack(
                self.bootstrap, chdb_url, database, self.backend, self.tmp / "stack", policy=policy
            )
        assert self.stack.store is not None
        return self.stack.store

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        self.pub.close()

    def submit(self, node: str | None = None, *script: str) -> str:
        """A job on `node` alone, or (None) on 3 or 4 of the cluster's 4 nodes, gpu03 among them:
        a requeue excluding gpu03 can run again on the other three. `script`: sbatch's script and
        options instead of a plain sleep."""
        where = [f"--nodelist={node}", "--nodes=1"] if node else ["--nodes=3-4"]
        out = _sh(
            self.cluster, "sbatch", "--parsable", *where, "--requeue", "--job-name=train", "--output=/dev/null",
            *(script or ("--wrap", "sleep 600")),
        )  # fmt: skip
        job = out.strip().split(";")[0]
        on = node or NODE
        wait_for(f"job {job} RUNNING on {on}", lambda: on in self.backend.job_state(job).nodes, timeout=60)
        return job

    def log(self, job: str, *lines: str, node: str = NODE, written_by_job: Path | None = None) -> None:
        """The job's output gains `lines`; the real job-log producer reads them (progress included),
        and what the job writes itself to `written_by_job` (named on the first call)."""
        if job not in self.logs:
            path = self.tmp / f"{job}.out"
            path.write_text("")
            paths = [path, *([written_by_job] if written_by_job else [])]
            self.logs[job] = path, JobLogProducer(self.pub, job, paths, JobLayout((node,), 8), partition="gpu")
        path, producer = self.logs[job]
        with path.open("a") as f:
            f.write("".join(x + "\n" for x in lines))
        producer.poll_once()
        assert self.pub.flush(10) == 0

    def gpu_sample(self, node: str = NODE) -> None:
        sample = self.nvml.sample(node)
        t = time.time()
        sample = sample.model_copy(update={"event_time": t, "event_id": stable_id("gpu", node, f"{t:.6f}")})
        self.pub.publish(GPU_SAMPLES, sample)
        assert self.pub.flush(10) == 0

    def placed(self, job: str, store: AuditStore, node: str = NODE, written_by_job: Path | None = None) -> None:
        """The worker knows the job checkpoints (its lineage) and runs on `node` (its placement)."""
        self.log(job, SAVED.format(step=400), node=node, written_by_job=written_by_job)
        wait_for(
            f"job {job}'s lineage",
            lambda: store.query("SELECT 1 FROM {db}.job_attempts FINAL WHERE job_id = {j:String}", {"j": job}),
            timeout=30,
        )
        self.slurm.poll_once()

        def forwarded() -> bool:
            self.gpu_sample(node)
            batches = [decode(GpuSampleBatch, v) for v in read_topic(self.bootstrap, GPU_SAMPLES_BY_JOB.name, 1.0)]
            return any(b.job_id == job for b in batches)

        wait_for(f"{node}'s samples forwarded to job {job} (its placement)", forwarded, timeout=30, interval=0.5)

    def remap_pending(self, gpu: int = 2, node: str = NODE) -> None:
        """GPU `gpu` of `node` reports a row remap pending: a GPU reset is required."""
        self.fake.gpus[gpu].remapped_rows = (0, 1, 1, 0)
        self.gpu_sample(node)
        self.fake.gpus[gpu].remapped_rows = (0, 0, 0, 0)


def _migration(store: AuditStore, job: str, state: str) -> dict[str, Any]:
    def found() -> list[dict[str, Any]]:
        return [m for m in job_migrations(store, job) if m["state"] == state]

    return wait_for(f"job {job}'s migration {state} in the audit", found, timeout=30)[0]


def _drained_for(backend: SlurmCliBackend, node: str, incident: str) -> bool:
    s = backend.node_state(node)
    return s.drained and incident in (s.reason or "")


def test_a_predicted_reset_drains_at_once_and_requeues_off_the_node_after_the_next_checkpoint(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    rig = Rig(broker, cluster, tmp_path)
    try:
        store = rig.start(chdb_url, database, _policy(tmp_path))
        job = rig.submit()
        rig.placed(job, store)
        rig.remap_pending()
        waiting = _migration(store, job, "waiting")
        incident = str(waiting["incident_id"])
        assert (waiting["node"], waiting["gpu"], waiting["checkpoint_before"]) == (NODE, 2, 400)
        # Drained at once, with the verdict in the reason; the job runs on and is not requeued yet.
        wait_for(f"{NODE} drained for {incident}", lambda: _drained_for(rig.backend, NODE, incident), timeout=30)
        reason = rig.backend.node_state(NODE).reason or ""
        assert reason == f"trainmedic {incident}: gpu_hardware", reason
        line = migration_line(waiting)
        assert "PENDING" in line and "waiting for checkpoint 401 or later" in line, line
        # An async save scheduled is not a durable checkpoint: nothing moves.
        rig.log(job, SCHEDULED.format(step=600))
        time.sleep(2)  # absence: the worker reads progress within a second; no requeue may follow
        state = rig.backend.job_state(job)
        assert (state.state, state.restart_count, NODE in state.nodes) == ("RUNNING", 0, True)
        # The save completes: requeued excluding gpu03, and running elsewhere.
        rig.log(job, SAVED.format(step=600))
        requeued = _migration(store, job, "requeued")
        assert requeued["checkpoint_step"] == 600
        wait_for(
            f"job {job} RUNNING again off {NODE}",
            lambda: (
                (s := rig.backend.job_state(job)).state == "RUNNING" and s.restart_count == 1 and NODE not in s.nodes
            ),
            timeout=60,
        )
        assert NODE in rig.backend.job_state(job).excluded_nodes
        assert rig.backend.node_state(NODE).drained  # the node stays out for its reset
        timeline = job_timeline(store, job)
        kinds = {i["kind"]: i for i in timeline["incidents"]}
        assert sorted(kinds) == ["predicted", "reactive"], timeline["incidents"]
        # gpu_health's own warning about the same pending remap: the migration answers it, nothing more.
        assert (kinds["reactive"]["culprit_node"], kinds["reactive"]["decision_action"]) == (NODE, "none")

        def results() -> list[tuple[str, str]]:
            rows = store.query(
                "SELECT action, status FROM {db}.action_results FINAL WHERE incident_id = {i:String} "
                "ORDER BY started_at",
                {"i": incident},
            )
            return [(r["action"], r["status"]) for r in rows]

        wait_for("both results in the audit", lambda: len(results()) == 2, timeout=30)
        assert results() == [("drain", "done"), ("requeue", "done")]
    finally:
        rig.stop()


def test_a_job_that_declares_its_checkpoint_signal_is_asked_for_one_and_moves_after_it(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    """The job's comment says its batch shell saves a checkpoint on USR1 (as sbatch --signal=B:USR1
    would): the drain is followed by that signal, the job writes its save line, and it is requeued."""
    rig = Rig(broker, cluster, tmp_path)
    written = tmp_path / "saves.out"
    written.write_text("")
    script = tmp_path / "train.sh"
    saved = SAVED.format(step=600)
    script.write_text(f"#!/bin/sh\ntrap 'echo \"{saved}\" >> {written}' USR1\nwhile :; do sleep 0.2; done\n")
    try:
        store = rig.start(chdb_url, database, _policy(tmp_path))
        job = rig.submit(None, "--comment=exp42 trainmedic=checkpoint_signal=B:USR1", str(script))
        rig.placed(job, store, written_by_job=written)
        rig.remap_pending()
        incident = str(_migration(store, job, "waiting")["incident_id"])
        wait_for("the job's save after the signal", lambda: saved in written.read_text(), timeout=30)
        rig.log(job)  # the producer reads what the job wrote
        assert _migration(store, job, "requeued")["checkpoint_step"] == 600
        drain = wait_for(
            "the drain's result",
            lambda: store.query(
                "SELECT steps FROM {db}.action_results FINAL WHERE incident_id = {i:String} AND action = 'drain'",
                {"i": incident},
            ),
            timeout=30,
        )[0]
        assert f"job {job}: asked for a checkpoint now (B:USR1, as its comment declares)" in drain["steps"]
        wait_for(
            f"job {job} RUNNING again off {NODE}",
            lambda: (
                (s := rig.backend.job_state(job)).state == "RUNNING" and s.restart_count == 1 and NODE not in s.nodes
            ),
            timeout=60,
        )
    finally:
        rig.stop()


def test_a_job_that_saves_no_checkpoint_falls_back_at_the_bound(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    rig = Rig(broker, cluster, tmp_path)
    try:
        store = rig.start(chdb_url, database, _policy(tmp_path, wait_s=4.0))
        job = rig.submit()
        rig.placed(job, store)
        rig.remap_pending()
        waiting = _migration(store, job, "waiting")
        fell = _migration(store, job, "fell_back")
        assert fell["updated_at"].timestamp() >= waiting["deadline"].timestamp()
        # The reactive path stays: the node drained, the job running on it, not requeued.
        assert _drained_for(rig.backend, NODE, str(waiting["incident_id"]))
        state = rig.backend.job_state(job)
        assert (state.state, state.restart_count, NODE in state.nodes) == ("RUNNING", 0, True)
        # A late checkpoint no longer moves it.
        rig.log(job, SAVED.format(step=600))
        time.sleep(2)  # absence: a requeue would be ordered within a second
        assert rig.backend.job_state(job).restart_count == 0
    finally:
        rig.stop()


def test_monitor_mode_only_recommends_and_an_approval_drains_the_node_only(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    rig = Rig(broker, cluster, tmp_path)
    try:
        store = rig.start(chdb_url, database, _policy(tmp_path, mode="monitor"), api=True)
        job = rig.submit()
        rig.placed(job, store)
        rig.remap_pending()
        decision = wait_for(
            "the predicted incident's decision",
            lambda: store.query(
                "SELECT * FROM {db}.decisions FINAL WHERE job_id = {j:String} AND startsWith(rule, 'prediction')",
                {"j": job},
            ),
            timeout=30,
        )[0]
        assert (decision["kind"], decision["action"], decision["mode"]) == ("recommendation", "drain", "monitor")
        assert str(decision["rule"]).startswith(f"prediction: drain {NODE} now")
        assert not rig.backend.node_state(NODE).drained
        assert job_migrations(store, job) == []
        assert store.query("SELECT 1 FROM {db}.actions FINAL WHERE job_id = {j:String}", {"j": job}) == []
        # An operator approves it: gpu03 is drained as a predictive drain; the job is not moved.
        assert rig.stack is not None and rig.stack.api is not None
        token = rig.stack.config.token_file.read_text().strip()
        with httpx.Client(base_url=rig.stack.api.url, timeout=30) as http:
            r = http.post(
                f"/api/recommendations/{decision['decision_id']}/approve",
                json={"operator": "alice"},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert r.status_code == 202, r.text
        wait_for(f"{NODE} drained on approval", lambda: rig.backend.node_state(NODE).drained, timeout=30)
        (action,) = [
            a for a in (decode(Action, v) for v in read_topic(rig.bootstrap, ACTIONS.name, 1.0)) if a.job_id == job
        ]
        assert (action.action, action.predicted, action.requested_by) == ("drain", True, "operator:alice")
        assert job_migrations(store, job) == [] and rig.backend.job_state(job).restart_count == 0
    finally:
        rig.stop()


def test_a_cancelled_migration_resumes_the_node_and_never_requeues(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    rig = Rig(broker, cluster, tmp_path)
    try:
        store = rig.start(chdb_url, database, _policy(tmp_path))
        job = rig.submit()
        rig.placed(job, store)
        rig.remap_pending()
        waiting = _migration(store, job, "waiting")
        incident = str(waiting["incident_id"])
        wait_for(f"{NODE} drained for {incident}", lambda: _drained_for(rig.backend, NODE, incident), timeout=30)
        done = cancel_migration(rig.backend, store, rig.pub, job, "alice", "the remap was a false alarm")
        assert done.resumed and done.node == NODE
        assert not rig.backend.node_state(NODE).drained
        cancelled = _migration(store, job, "cancelled")
        assert cancelled["requested_by"] == "alice"
        # The worker dropped the wait: the next checkpoint moves nothing.
        rig.log(job, SAVED.format(step=600))
        time.sleep(2)  # absence: a requeue would be ordered within a second
        state = rig.backend.job_state(job)
        assert (state.state, state.restart_count) == ("RUNNING", 0)
        assert [m["state"] for m in job_migrations(store, job)] == ["cancelled"]
    finally:
        rig.stop()


def test_a_pending_migration_survives_restarts_of_the_worker_and_the_executor(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    rig = Rig(broker, cluster, tmp_path)
    try:
        store = rig.start(chdb_url, database, _policy(tmp_path))
        job = rig.submit()
        rig.placed(job, store)
        rig.remap_pending()
        incident = str(_migration(store, job, "waiting")["incident_id"])
        wait_for(f"{NODE} drained for {incident}", lambda: _drained_for(rig.backend, NODE, incident), timeout=30)
        stack = rig.stack
        assert stack is not None and stack.executor is not None
        stack._restart_worker(0)
        stack.executor.stop_event.set()
        wait_for("the executor stopped", lambda: not stack._thread_alive("executor"), timeout=30)
        stack._start_executor()
        rig.log(job, SAVED.format(step=600))
        _migration(store, job, "requeued")
        wait_for(
            f"job {job} RUNNING again off {NODE}",
            lambda: (
                (s := rig.backend.job_state(job)).state == "RUNNING" and s.restart_count == 1 and NODE not in s.nodes
            ),
            timeout=60,
        )
    finally:
        rig.stop()


def test_predictive_drains_stop_at_their_cap_while_a_reactive_drain_goes_through(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    rig = Rig(broker, cluster, tmp_path)
    try:
        # One drain of each kind per window: the predictive one must not spend the reactive one.
        store = rig.start(chdb_url, database, _policy(tmp_path, max_drains_per_window=1))
        first, second = rig.submit("gpu03"), rig.submit("gpu04")
        rig.placed(first, store, "gpu03")
        rig.placed(second, store, "gpu04")
        rig.remap_pending(node="gpu03")
        rig.remap_pending(node="gpu04")
        trip = wait_for(
            "the predictive cap's trip",
            lambda: store.query("SELECT * FROM {db}.guardrail_trips FINAL WHERE guardrail = 'blast_radius'"),
            timeout=30,
        )[0]
        assert "max_predictive_drains_per_window is 1" in str(trip["detail"]), trip
        capped = "gpu04" if trip["node"] == "gpu04" else "gpu03"
        drained = "gpu03" if capped == "gpu04" else "gpu04"
        assert rig.backend.node_state(drained).drained and not rig.backend.node_state(capped).drained
        # A real fault on another node: its drain is the reactive budget's, still whole.
        kern = tmp_path / "kern.log"
        kern.write_text(xid79_line("gpu01") + "\n")
        KernelLogProducer(rig.pub, kern, node="gpu01", from_start=True).poll_once()
        assert rig.pub.flush(10) == 0
        wait_for(
            "gpu01 drained for its Xid 79",
            lambda: (s := rig.backend.node_state("gpu01")).drained and "trainmedic inc-" in (s.reason or ""),
            timeout=30,
        )
    finally:
        rig.stop()
