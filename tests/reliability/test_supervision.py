"""`trainmedic up` supervises its parts, through the real command: a SIGKILLed streams worker
is restarted while /api/health answers 503 naming it, and a Xid written in the gap becomes one
incident once the worker is back; a SIGKILLed `up` takes its broker and worker with it; a
busy port or a live `up` on the same data dir is refused before anything starts; a part that
keeps crashing stops `up` with a non-zero exit naming it; a dead audit sink thread is restarted
and the events of its gap land in the audit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.publish import Publisher
from producers.kernel import KernelLogProducer
from schemas.codec import decode
from schemas.events import Action, ActionResult
from schemas.topics import ACTION_RESULTS, ACTIONS, INCIDENTS
from sinks.audit import AuditStore
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import read_topic, wait_for
from tests.integration.scenario import xid79_line
from tests.reliability.harness import incident, produce
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

REPO = Path(__file__).resolve().parents[2]
TRAINMEDIC = [sys.executable, "-m", "trainmedic.cli.main"]


def children(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Up:
    """`trainmedic up --backend simulated` as an operator starts it, output in a file."""

    def __init__(self, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.log = data_dir.parent / f"{data_dir.name}-up.out"
        self._fh = open(self.log, "w")  # noqa: SIM115 - closed in close()
        args = ["up", "--backend", "simulated", "--api-port", "0", "--metrics-port", "0"]
        args += ["--metrics-address", "127.0.0.1:0", "--data-dir", str(data_dir), *extra]
        self.proc = subprocess.Popen(
            [*TRAINMEDIC, *args], stdout=self._fh, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout: float = 180) -> dict[str, Any]:
        def up() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"`up` exited ({self.proc.returncode}):\n{self.text()[-3000:]}")
            return "trainmedic is up" in self.text()

        wait_for("trainmedic is up", up, timeout=timeout)
        info: dict[str, Any] = json.loads((self.data_dir / "runtime.json").read_text())
        return info

    def token(self) -> str:
        return (self.data_dir / "api-token").read_text().strip()

    def health(self, api_url: str) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"{api_url}/api/health", timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def get(self, api_url: str, path: str) -> Any:
        req = urllib.request.Request(f"{api_url}{path}", headers={"Authorization": f"Bearer {self.token()}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def child(self, needle: str) -> int:
        pids = [p for p in children(self.proc.pid) if needle in cmdline(p)]
        assert len(pids) == 1, (needle, [cmdline(p) for p in children(self.proc.pid)])
        return pids[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()


def _requeue_action(action_id: str, job: str) -> Action:
    now = time.time()
    return Action(
        event_id=action_id,
        event_time=now,
        action_id=action_id,
        decision_id=f"dec-{action_id}",
        incident_id=f"inc-{action_id}",
        job_id=job,
        node=None,
        partition="gpu",
        action="requeue",
        reason=f"trainmedic inc-{action_id}: hang",
        requested_by="policy",
        incident_time=now,
        first_signal_time=now - 1,
    )


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path / "var")
    yield u
    u.close()


def test_killed_worker_is_restarted_unhealthy_in_between_and_the_gap_is_not_lost(up: Up, tmp_path: Path) -> None:
    info = up.wait_up()
    api = info["api_url"]
    assert up.health(api) == (200, up.health(api)[1]) and up.health(api)[1]["ok"] is True
    # The start line says what a restart loses, and runtime.json what producers should re-read.
    assert "keeps events in memory only" in up.text() and "the audit is the durable record" in up.text()
    assert info["broker_storage"] == "memory" and "re-read 'bootstrap'" in info["note"]

    worker = up.child("trainmedic.stack.streams_worker")
    os.kill(worker, signal.SIGKILL)
    code, report = wait_for("health 503 after the kill", lambda: (h := up.health(api))[0] == 503 and h, timeout=30)
    assert report["components"]["streams-worker"]["state"] == "restarting"
    assert "signal SIGKILL" in report["down"]["streams-worker"]
    # The console's status carries the same view.
    assert up.get(api, "/api/console/status")["stack"]["ok"] is False

    # A Xid 79 written while no worker runs.
    kern = tmp_path / "kern.log"
    kern.write_text(xid79_line("gpu07") + "\n")
    pub = Publisher(info["bootstrap"], "test-producer")
    KernelLogProducer(pub, kern, node="gpu07", from_start=True).poll_once()
    assert pub.flush(10) == 0

    wait_for("health 200 again", lambda: up.health(api)[0] == 200, timeout=180)
    status = up.health(api)[1]["components"]["streams-worker"]
    assert status == {"state": "up", "restarts": 1, "reason": None}
    new_worker = up.child("trainmedic.stack.streams_worker")
    assert new_worker != worker and not running(worker)
    assert "supervisor: streams-worker died (signal SIGKILL" in up.text()
    assert "streams-worker is back (restart 1)" in up.text()

    def gpu07_incidents() -> list[dict[str, Any]]:
        rows = up.get(api, "/api/incidents?since=1h")
        return [r for r in rows if r.get("culprit_node") == "gpu07"]

    wait_for("the gap's Xid as an incident", gpu07_incidents, timeout=120)
    time.sleep(3)  # a duplicate would come right behind it
    assert len(gpu07_incidents()) == 1


@pytest.fixture
def quick_watchdog_up(tmp_path: Path) -> Iterator[Up]:
    """`up` whose consumer watchdog acts after seconds, not the default 20 s (bus/watchdog.py)."""
    u = Up(
        tmp_path / "var",
        env={"TRAINMEDIC_CONSUMER_STALL_S": "5", "TRAINMEDIC_CONSUMER_STALL_GIVE_UP_S": "60"},
    )
    yield u
    u.close()


def test_killed_broker_comes_back_on_its_port_with_its_topics_and_the_loop_works(
    quick_watchdog_up: Up, tmp_path: Path
) -> None:
    up = quick_watchdog_up
    from confluent_kafka.admin import AdminClient

    from bus.config import admin_config
    from schemas.topics import ALL_TOPICS, DEFAULT_PARTITIONS

    info = up.wait_up()
    api = info["api_url"]
    broker, worker = up.child("tansu"), up.child("trainmedic.stack.streams_worker")
    os.kill(broker, signal.SIGKILL)
    code, report = wait_for("health 503 naming the broker", lambda: (h := up.health(api))[0] == 503 and h, timeout=30)
    assert report["down"]["broker"] == "signal SIGKILL"
    wait_for("health 200 again", lambda: up.health(api)[0] == 200, timeout=180)
    assert up.health(api)[1]["components"]["broker"]["restarts"] == 1
    # Same address; every topic with its partition count; a fresh worker (its state went with the broker).
    assert f"tcp://127.0.0.1:{info['broker_port']}" in cmdline(up.child("tansu"))
    topics = AdminClient(admin_config(info["bootstrap"])).list_topics(timeout=10).topics
    assert {t.name: len(topics[t.name].partitions) for t in ALL_TOPICS} == {
        t.name: DEFAULT_PARTITIONS for t in ALL_TOPICS
    }
    assert up.child("trainmedic.stack.streams_worker") != worker
    assert "events it held that no consumer had read are lost" in up.text()

    kern = tmp_path / "kern.log"
    kern.write_text(xid79_line("gpu05") + "\n")
    pub = Publisher(info["bootstrap"], "test-producer")
    KernelLogProducer(pub, kern, node="gpu05", from_start=True).poll_once()
    # The executor acts again (issue 40): an action published to the new broker gets its result. The
    # simulated scheduler of `up` has no job, so the requeue fails, and says so: what counts is that
    # the executor took the action from the topic and answered it.
    pub.publish(ACTIONS, _requeue_action("act-after-restart", "4242"))
    assert pub.flush(10) == 0
    wait_for(
        "an incident from the new broker",
        lambda: [r for r in up.get(api, "/api/incidents?since=1h") if r.get("culprit_node") == "gpu05"],
        timeout=120,
    )
    result = wait_for(
        "the executor's result for an action published to the new broker",
        lambda: next(
            (
                r
                for v in read_topic(info["bootstrap"], ACTION_RESULTS.name, 1.0)
                if (r := decode(ActionResult, v)).action_id == "act-after-restart"
            ),
            None,
        ),
        timeout=90,
    )
    assert result.status == "failed" and "4242" in (result.error or "")


def test_sigkill_of_up_leaves_no_process_of_its_tree(up: Up) -> None:
    up.wait_up()
    kids = children(up.proc.pid)
    assert any("tansu" in cmdline(p) for p in kids) and any("streams_worker" in cmdline(p) for p in kids)
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait(30)
    wait_for("broker and worker gone", lambda: not any(running(p) for p in kids), timeout=30)


def test_busy_port_and_live_up_are_refused_before_anything_starts(up: Up, tmp_path: Path) -> None:
    info = up.wait_up()
    api_port = int(info["api_url"].rsplit(":", 1)[1])
    other = tmp_path / "other"
    proc = subprocess.run(
        [*TRAINMEDIC, "up", "--backend", "simulated", "--api-port", str(api_port), "--data-dir", str(other)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode != 0
    assert f"--api-port (operator API): port 127.0.0.1:{api_port} is already in use by pid {up.proc.pid}" in proc.stderr
    assert "Nothing was started" in proc.stderr and "trainmedic is up" not in proc.stdout
    assert not other.exists() or not (other / "logs").exists()

    same = subprocess.run(
        [*TRAINMEDIC, "up", "--backend", "simulated", "--api-port", "0", "--data-dir", str(up.data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert same.returncode != 0
    assert f"trainmedic (pid {up.proc.pid}) is still running on this data dir" in same.stderr
    # The refused start left the running one's runtime file alone.
    assert json.loads((up.data_dir / "runtime.json").read_text())["pid"] == up.proc.pid


def test_restarted_up_keeps_the_broker_port(tmp_path: Path) -> None:
    first = Up(tmp_path / "var")
    try:
        port = first.wait_up()["broker_port"]
        first.proc.send_signal(signal.SIGKILL)  # no clean stop: runtime.json stays behind, stale
        first.proc.wait(30)
    finally:
        first.close()
    wait_for("the old broker gone", lambda: not _listening(port), timeout=30)
    second = Up(tmp_path / "var")
    try:
        info = second.wait_up()
        assert info["broker_port"] == port and info["pid"] == second.proc.pid
        assert "stale" in second.text() and "no longer running" in second.text()
    finally:
        second.close()


def _listening(port: int) -> bool:
    from trainmedic.stack.broker import port_in_use

    return port_in_use("127.0.0.1", port)


def test_a_part_that_keeps_crashing_stops_up_non_zero_naming_it(tmp_path: Path) -> None:
    u = Up(tmp_path / "var", "--max-crashes", "0")
    try:
        u.wait_up()
        kids = children(u.proc.pid)
        worker = u.child("trainmedic.stack.streams_worker")
        os.kill(worker, signal.SIGKILL)
        rc = u.proc.wait(120)
        out = u.text()
        assert rc == 3, out[-3000:]
        assert "trainmedic stopped: streams-worker crashed 1 time within 300 s (last: signal SIGKILL" in out
        assert kids and not any(running(p) for p in kids)
    finally:
        u.close()


def test_dead_audit_sink_thread_is_restarted_and_nothing_is_lost(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    """In-process Stack as `up` runs it: the audit sink's loop ends under it."""
    stack = Stack(
        StackConfig(
            data_dir=tmp_path / "var",
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            supervise=True,
            restart_backoff_s=(2.0,),
        ),
        SimulatedScheduler([]),
    ).start()
    try:
        store, sink = stack.store, stack.sink
        assert store is not None and sink is not None
        produce(broker.bootstrap, [(INCIDENTS.name, incident(i, prefix="sup")) for i in range(3)])
        wait_for("the first incidents in the audit", lambda: _incidents(store, "sup") == 3)
        # The loop ends without the stack asking (closing its consumer from here can deadlock
        # librdkafka, so the loop is told to end): the thread is gone, whatever the cause.
        sink.stop_event.set()
        report = wait_for("the sink reported down", lambda: (h := stack.health())["ok"] is False and h, timeout=30)
        assert report["components"]["audit-sink"]["state"] == "restarting"
        produce(broker.bootstrap, [(INCIDENTS.name, incident(i, prefix="sup")) for i in range(3, 6)])
        wait_for("the sink back", lambda: stack.health()["ok"], timeout=60)
        assert stack.sink is not sink and stack.health()["components"]["audit-sink"]["restarts"] == 1
        wait_for("every incident in the audit", lambda: _incidents(store, "sup") == 6, timeout=60)
    finally:
        stack.stop()


def _incidents(store: AuditStore, prefix: str) -> int:
    sql = "SELECT count() AS n FROM {db}.incidents FINAL WHERE startsWith(incident_id, {p:String})"
    return int(store.query(sql, {"p": f"inc-{prefix}-"})[0]["n"])
