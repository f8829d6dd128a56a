"""The Slurm producer against the REAL local Slurm clusters, 22.05
(infra/slurm/start.sh) and 24.11 (infra/slurm/start-2411.sh): each test that
acts on Slurm runs on both. The real embedded broker carries the events.

Every test starts and ends with no job of root's and gpu01..gpu04 idle, undrained.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from bus.config import consumer_config
from bus.publish import Publisher
from producers.slurm import LocalRunner, NodeView, SlurmProducer, expand_hostlist, parse_sinfo
from schemas.codec import decode
from schemas.events import SchedEvent
from schemas.topics import SCHED_EVENTS
from tests.conftest import Cluster, wait_for
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03", "gpu04")


def _sh(cluster: Cluster, *argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=cluster.env(), timeout=30, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


def _nodes(cluster: Cluster) -> dict[str, NodeView]:
    return parse_sinfo(json.loads(_sh(cluster, "sinfo", "--json")))


def _all_idle(cluster: Cluster) -> bool:
    nodes = _nodes(cluster)
    return all(nodes[n].state == "IDLE" and not nodes[n].flags for n in NODES)


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    def reset() -> None:
        _sh(slurm_any, "scancel", "--user", "root")
        for name, node in _nodes(slurm_any).items():
            if node.state == "DOWN" or "DRAIN" in node.flags:
                _sh(slurm_any, "scontrol", "update", f"nodename={name}", "state=resume")
        wait_for("all nodes idle and unflagged", lambda: _all_idle(slurm_any), timeout=60)

    reset()
    yield slurm_any
    reset()


def _poll_until(
    producer: SlurmProducer, seen: list[SchedEvent], what: str, match: Callable[[SchedEvent], bool]
) -> SchedEvent:
    def probe() -> SchedEvent | None:
        seen.extend(producer.poll_once())
        return next((e for e in seen if match(e)), None)

    found: SchedEvent = wait_for(what, probe, timeout=60, interval=0.3)
    return found


def _poll_until_quiet(producer: SlurmProducer, seen: list[SchedEvent]) -> None:
    """Poll until one poll brings nothing new (e.g. COMPLETING has settled)."""

    def probe() -> bool:
        events = producer.poll_once()
        seen.extend(events)
        return not events

    wait_for("a poll with no changes", probe, timeout=60, interval=0.5)


def _read_back(bootstrap: str, want_ids: set[str]) -> dict[str, SchedEvent]:
    consumer = Consumer(consumer_config(bootstrap, f"t-{uuid.uuid4().hex[:8]}", "test-slurm-producer"))
    consumer.subscribe([SCHED_EVENTS.name])
    got: dict[str, SchedEvent] = {}

    def probe() -> bool:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            ev = decode(SchedEvent, msg.value() or b"")
            got[ev.event_id] = ev
        return want_ids <= set(got)

    try:
        wait_for(f"{len(want_ids)} events read back from {SCHED_EVENTS.name}", probe, timeout=60, interval=0)
    finally:
        consumer.close()
    return got


def test_job_and_node_changes_restart_and_idempotent_ids(
    broker: EmbeddedBroker, cluster: Cluster, tmp_path: Path
) -> None:
    state = tmp_path / "slurm-state.json"
    publisher = Publisher(broker.bootstrap, "test-slurm-producer")
    published: list[SchedEvent] = []

    # A cold start: the cluster as it is becomes the baseline; one marker, nothing else.
    producer = SlurmProducer(publisher, runner=cluster.runner(), interval_s=1.0, state_path=state)
    first = producer.poll_once()
    published += first
    assert [(e.state, e.flags) for e in first] == [("SNAPSHOT", ["COLD_START"])]
    assert state.is_file()

    # Held at submission, so PENDING is certainly seen before RUNNING.
    job = _sh(
        cluster, "sbatch", "--parsable", "--hold", "--job-name=tm-producer", "--output=/dev/null", "--wrap", "sleep 600"
    ).strip()
    pending = _poll_until(producer, published, "the PENDING event", lambda e: e.job_id == job and e.state == "PENDING")
    assert (pending.kind, pending.previous_state, pending.nodes, pending.partition) == ("job", None, [], "gpu")

    _sh(cluster, "scontrol", "release", job)
    running = _poll_until(producer, published, "the RUNNING event", lambda e: e.job_id == job and e.state == "RUNNING")
    assert running.previous_state == "PENDING"
    assert running.nodes and set(running.nodes) <= set(NODES)
    assert running.partition == "gpu"
    # Who runs it, for policy rules that match on the job's name, user or account.
    assert (running.job_name, running.user) == ("tm-producer", pwd.getpwuid(os.getuid()).pw_name)

    idle = sorted(set(NODES) - set(running.nodes))
    drained = idle[-1]
    reason = "trainmedic test: producer sees drains"
    _sh(cluster, "scontrol", "update", f"nodename={drained}", "state=drain", f"reason={reason}")
    drain = _poll_until(
        producer,
        published,
        "the DRAIN node event",
        lambda e: e.kind == "node" and e.node == drained and "DRAIN" in e.flags,
    )
    assert (drain.state, drain.previous_state, drain.reason) == ("IDLE", "IDLE", reason)

    _sh(cluster, "scancel", job)
    cancelled = _poll_until(
        producer, published, "the CANCELLED event", lambda e: e.job_id == job and e.state == "CANCELLED"
    )
    assert cancelled.previous_state in ("RUNNING", "COMPLETING")
    assert cancelled.nodes == running.nodes
    # scancel sends SIGTERM: Slurm records "signal 15", or "exit 143" (128 + 15) when the batch
    # shell caught it and exited itself first - which of the two is a race (a loaded CI machine saw both).
    assert cancelled.reason is not None and ("signal 15" in cancelled.reason or "exit 143" in cancelled.reason)
    _poll_until_quiet(producer, published)
    ids = [e.event_id for e in published]
    assert len(ids) == len(set(ids)), "an event id was used twice"
    # Each change once, in order, for this job.
    assert [e.state for e in published if e.job_id == job and e.state != "COMPLETING"] == [
        "PENDING",
        "RUNNING",
        "CANCELLED",
    ]

    # A restart with the same state file: one marker, none of the changes again.
    restarted = SlurmProducer(publisher, runner=cluster.runner(), state_path=state)
    again = restarted.poll_once()
    assert [(e.state, e.flags) for e in again if e.state == "SNAPSHOT"] == [("SNAPSHOT", ["WARM_START"])]
    assert again[0].state == "SNAPSHOT"
    assert drained in again[0].nodes  # the marker lists what is unavailable now
    others = again[1:]
    # Only an unrelated job of someone else's could age out of squeue meanwhile.
    assert all(e.kind == "job" and e.state == "GONE" and e.job_id != job for e in others), others
    assert not {e.event_id for e in again} & set(ids)
    published += again

    # Changes while no producer runs are reported by the next start, after its marker.
    _sh(cluster, "scontrol", "update", f"nodename={drained}", "state=resume")
    wait_for(f"{drained} idle and unflagged", lambda: _all_idle(cluster), timeout=60)
    before_crash = tmp_path / "before-crash.json"
    shutil.copy(state, before_crash)
    third = SlurmProducer(publisher, runner=cluster.runner(), state_path=state)
    warm = third.poll_once()
    assert warm[0].state == "SNAPSHOT" and warm[0].flags == ["WARM_START"]
    resumed = [e for e in warm if e.kind == "node" and e.node == drained]
    assert len(resumed) == 1
    assert (resumed[0].state, resumed[0].flags, resumed[0].reason) == ("IDLE", [], None)
    published += warm

    # A crash before the state was saved: the next start re-emits the same changes with the same ids.
    shutil.copy(before_crash, state)
    replay = SlurmProducer(publisher, runner=cluster.runner(), state_path=state).poll_once()
    assert [e.event_id for e in replay if e.kind == "node" or e.state == "SNAPSHOT"] == [
        e.event_id for e in warm if e.kind == "node" or e.state == "SNAPSHOT"
    ]
    published += replay

    assert producer.failed_polls == {} and restarted.failed_polls == {} and third.failed_polls == {}
    assert publisher.flush(10) == 0
    back = _read_back(broker.bootstrap, {e.event_id for e in published})
    assert back[running.event_id].nodes == running.nodes
    assert back[drain.event_id].reason == reason
    assert back[cancelled.event_id].state == "CANCELLED"


def test_failed_polls_are_counted_and_never_end_run(broker: EmbeddedBroker, tmp_path: Path) -> None:
    publisher = Publisher(broker.bootstrap, "test-slurm-producer")
    # No squeue on PATH: the command cannot be run at all.
    runner = LocalRunner()
    runner.env = {**runner.env, "PATH": str(tmp_path)}
    producer = SlurmProducer(publisher, state_path=tmp_path / "state.json", runner=runner)
    assert producer.poll_once() == []
    assert producer.failed_polls == {"command": 1}
    assert producer.last_error and "could not be run" in producer.last_error

    # A missing slurm.conf makes squeue retry for a minute: the timeout ends each poll.
    producer = SlurmProducer(
        publisher,
        slurm_conf=str(tmp_path / "no-such-slurm.conf"),
        interval_s=0.05,
        state_path=tmp_path / "state.json",
        command_timeout_s=1,
    )
    stop = threading.Event()
    thread = threading.Thread(target=producer.run, args=(stop,), daemon=True)
    thread.start()
    wait_for("two failed polls inside run()", lambda: producer.failed_polls["command"] >= 2, timeout=60)
    assert thread.is_alive()
    assert producer.last_error and "timed out" in producer.last_error
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert not (tmp_path / "state.json").exists()  # a failed poll changes no state


@pytest.mark.parametrize(
    "text", ["gpu[01-03,05]", "a[1-2]b[3-4]", "n[8-10]", "n[08-10]", "n[1-010]", "gpu01,cpu[1-2]", "rack[1-2]-n[01-02]"]
)
def test_hostlist_expander_agrees_with_scontrol(slurm_any: Cluster, text: str) -> None:
    assert expand_hostlist(text) == _sh(slurm_any, "scontrol", "show", "hostnames", text).split()
