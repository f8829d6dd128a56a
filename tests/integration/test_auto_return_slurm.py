"""The automatic return to service on the REAL Slurm clusters (#20 item 4).

Real parts throughout: the embedded broker, chDB, the local Slurm 22.05 and 24.11, a real
executor holding its acting lease, the audit sink, and the policy's health check over a real
sshd (the "diagnostic" fails while a marker file for the node exists; every check is one SSH
login, so the sshd's log says how many checks ran). Node gpu04 only: other tests use the
others at the same time.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from schemas.codec import decode
from schemas.events import NodeReturn
from schemas.topics import NODE_RETURNS
from sinks.audit import AuditSink, AuditStore
from sinks.audit_schema import NODE_RETURNS_T
from sinks.backends.slurm_cli import SlurmCliBackend
from sinks.executor import Executor, ExecutorService, ExecutorSettings
from sinks.guardrails import GuardrailFile, Guardrails
from streams.policy import DEFAULT_POLICY
from tests.conftest import Cluster, read_topic, slurm_cmd, wait_for
from tests.integration.test_slurm_ssh import SshServer, sshd  # noqa: F401 (the module's sshd fixture)
from trainmedic.cli.audit import audit_app
from trainmedic.ops.auto_return import AUTO_OPERATOR, AutoReturnService
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig

pytestmark = pytest.mark.slurm
NODE = "gpu04"
REASON = "trainmedic inc-auto0001: gpu_hardware"
INTERVAL_S = 0.3


def _release(backend: SlurmCliBackend, cluster: Cluster) -> None:
    state = backend.node_state(NODE)
    if state.drained or state.state == "DOWN":
        slurm_cmd(cluster, "scontrol", "update", f"nodename={NODE}", "state=resume")
    wait_for(f"{NODE} idle", lambda: (n := backend.node_state(NODE)).state == "IDLE" and not n.flags, timeout=60)


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, SlurmCliBackend]]:
    cluster: Cluster = request.getfixturevalue(getattr(request, "param", "slurm_cluster"))
    backend = SlurmCliBackend(cluster.runner())
    _release(backend, cluster)
    yield cluster, backend
    _release(backend, cluster)


def _policy(
    tmp: Path,
    ssh: SshServer,
    *,
    mode: str = "autonomous",
    kill_switch: bool = False,
    **automatic: Any,
) -> Path:
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data["mode"] = mode
    data.setdefault("guardrails", {})["kill_switch"] = kill_switch
    data["return_to_service"] = {
        "health_check": [
            "ssh",
            "-p",
            str(ssh.port),
            "-i",
            str(ssh.user_key),
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={ssh.known_hosts}",
            f"{ssh.user}@{ssh.host}",
            f"test ! -e {tmp}/broken-{{node}} || {{ echo 'dcgmi diag: GPU 3 memory test FAIL'; exit 1; }}",
        ],
        "timeout_s": 60,
        "automatic": {
            "enabled": True,
            "after_s": 0,
            "retry_s": 3600,
            "max_per_hour": 4,
            "interval_s": INTERVAL_S,
            **automatic,
        },
    }
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _returns(store: AuditStore) -> list[dict[str, Any]]:
    return store.query(
        "SELECT outcome, operator, check_passed, detail FROM {db}.node_returns FINAL WHERE node = {n:String} "
        "ORDER BY event_time",
        {"n": NODE},
    )


def _on_topic(bootstrap: str) -> list[NodeReturn]:
    return [decode(NodeReturn, raw) for raw in read_topic(bootstrap, NODE_RETURNS.name, seconds=1.5)]


def _quiet(svc: AutoReturnService, status: str, ssh: SshServer, seconds: float = 2.5) -> None:
    """Passes keep running (the status says `status`), and no check runs meanwhile."""
    wait_for(f"a pass saying {status!r}", lambda: status in svc.status, timeout=30)
    logins = ssh.logins()
    time.sleep(seconds)
    assert status in svc.status
    assert ssh.logins() == logins, "a health check ran"


@contextlib.contextmanager
def _running(
    bootstrap: str, backend: SlurmCliBackend, store: AuditStore, policy: Path, tmp: Path
) -> Iterator[AutoReturnService]:
    """The executor (its acting lease), the audit sink and the automatic path, as `up` runs them."""
    sink = AuditSink(bootstrap, store, group="audit-auto", batch_wait_s=0.2)
    executor = ExecutorService(
        bootstrap,
        Executor(backend, ExecutorSettings(verify_timeout_s=10, group="executor-auto")),
        Guardrails(GuardrailFile(policy), backend),
    )
    auto = AutoReturnService(
        backend,
        store,
        bootstrap,
        policy,
        acting=lambda: executor.acting,
        guardrails=GuardrailFile(policy),
        modes_file=tmp / "modes.yaml",
    )
    threads = [threading.Thread(target=f, daemon=True) for f in (sink.run, executor.run, auto.run)]
    for t in threads:
        t.start()
    try:
        wait_for("the executor holding its acting lease", lambda: executor.acting, timeout=60)
        yield auto
    finally:
        for svc in (auto, executor, sink):
            svc.stop_event.set()
        for t in threads:
            t.join(30)


def _store(chdb_url: str, database: str) -> AuditStore:
    store = AuditStore(chdb_url, database)
    store.migrate()
    return store


def _drained(backend: SlurmCliBackend, reason: str) -> Callable[[], bool]:
    return lambda: (s := backend.node_state(NODE)).drained and s.reason == reason


@pytest.mark.parametrize("node", ["slurm_cluster", "slurm2411_cluster"], indirect=True)
def test_up_returns_a_node_whose_check_passes_and_rechecks_a_failing_one_only_after_retry_s(
    broker: EmbeddedBroker,
    node: tuple[Cluster, SlurmCliBackend],
    sshd: SshServer,  # noqa: F811
    chdb_url: str,
    database: str,
    tmp_path: Path,
) -> None:
    _, backend = node
    (tmp_path / f"broken-{NODE}").touch()
    backend.drain_node(NODE, REASON)
    # Slurm's own time of the drain reason, which after_s is counted from (sinfo / scontrol JSON).
    listed = next(n for n in backend.list_nodes() if n.name == NODE)
    assert listed.reason_time is not None and abs(time.time() - listed.reason_time) < 60
    policy = _policy(tmp_path, sshd)
    config = StackConfig(
        data_dir=tmp_path, bootstrap=broker.bootstrap, clickhouse=chdb_url, database=database, policy=policy
    )
    stack = Stack(config, backend).start()
    try:
        assert stack.store is not None and stack.auto_return is not None
        store = stack.store
        # The diagnostic fails: refused, with its output, and the node stays drained.
        rows = wait_for("the automatic verdict in the audit", lambda: _returns(store), timeout=90)
        assert [(r["outcome"], r["operator"], r["check_passed"]) for r in rows] == [("refused", AUTO_OPERATOR, False)]
        assert "GPU 3 memory test FAIL" in rows[0]["detail"]
        assert _drained(backend, REASON)()
        # Fixed now, but judged within retry_s: not checked again, not resumed...
        (tmp_path / f"broken-{NODE}").unlink()
        _quiet(stack.auto_return, "on: nothing to judge; 1 drained", sshd)
        assert _drained(backend, REASON)() and len(_returns(store)) == 1
    finally:
        stack.stop()
    # ...nor after a restart: the verdict is read back from the audit's node_returns.
    logins = sshd.logins()
    stack = Stack(config, backend).start()
    try:
        assert stack.store is not None and stack.auto_return is not None
        store = stack.store
        _quiet(stack.auto_return, "on: nothing to judge; 1 drained", sshd)
        assert sshd.logins() == logins and _drained(backend, REASON)()
        # Past retry_s the check runs again, passes over SSH, and Slurm resumes the node: no API call.
        policy.write_text(policy.read_text().replace("retry_s: 3600", "retry_s: 1"))
        wait_for(f"{NODE} resumed", lambda: not backend.node_state(NODE).drained, timeout=60)
        rows = wait_for("the return in the audit", lambda: r if len(r := _returns(store)) == 2 else None)
        assert [(r["outcome"], r["operator"], r["check_passed"]) for r in rows][-1] == ("resumed", AUTO_OPERATOR, True)
        assert "health check passed on gpu04" in rows[-1]["detail"]
    finally:
        stack.stop()
    # `trainmedic audit node` shows who returned it.
    result = CliRunner().invoke(
        audit_app, ["node", NODE, "--clickhouse", chdb_url, "--database", database, "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)["returns"]
    assert [(r["outcome"], r["operator"]) for r in shown] == [("resumed", AUTO_OPERATOR), ("refused", AUTO_OPERATOR)]


def test_monitor_mode_judges_and_recommends_but_does_not_resume(
    broker: EmbeddedBroker,
    node: tuple[Cluster, SlurmCliBackend],
    sshd: SshServer,  # noqa: F811
    chdb_url: str,
    database: str,
    tmp_path: Path,
) -> None:
    _, backend = node
    backend.drain_node(NODE, REASON)
    store = _store(chdb_url, database)
    try:
        with _running(broker.bootstrap, backend, store, _policy(tmp_path, sshd, mode="monitor"), tmp_path):
            rows = wait_for("the recommendation in the audit", lambda: _returns(store), timeout=60)
        assert [(r["outcome"], r["operator"], r["check_passed"]) for r in rows] == [
            ("recommended", AUTO_OPERATOR, True)
        ]
        assert "health check passed on gpu04" in rows[0]["detail"] and "monitor mode" in rows[0]["detail"]
        assert _drained(backend, REASON)()
    finally:
        store.close()


def test_the_kill_switch_stops_all_judging(
    broker: EmbeddedBroker,
    node: tuple[Cluster, SlurmCliBackend],
    sshd: SshServer,  # noqa: F811
    chdb_url: str,
    database: str,
    tmp_path: Path,
) -> None:
    _, backend = node
    backend.drain_node(NODE, REASON)
    policy = _policy(tmp_path, sshd, kill_switch=True)
    store = _store(chdb_url, database)
    try:
        with _running(broker.bootstrap, backend, store, policy, tmp_path) as auto:
            _quiet(auto, "kill switch", sshd)
            assert _on_topic(broker.bootstrap) == [] and _drained(backend, REASON)()
            # Released: the same node is judged and returned at once.
            _policy(tmp_path, sshd, kill_switch=False)
            wait_for(f"{NODE} resumed", lambda: not backend.node_state(NODE).drained, timeout=60)
        assert [(e.outcome, e.operator) for e in _on_topic(broker.bootstrap)] == [("resumed", AUTO_OPERATOR)]
    finally:
        store.close()


def test_someone_elses_drain_and_a_repair_label_are_left_alone(
    broker: EmbeddedBroker,
    node: tuple[Cluster, SlurmCliBackend],
    sshd: SshServer,  # noqa: F811
    chdb_url: str,
    database: str,
    tmp_path: Path,
) -> None:
    cluster, backend = node
    theirs = "admin: bad PSU"
    slurm_cmd(cluster, "scontrol", "update", f"nodename={NODE}", "state=drain", f"reason={theirs}")
    store = _store(chdb_url, database)
    try:
        with _running(broker.bootstrap, backend, store, _policy(tmp_path, sshd), tmp_path) as auto:
            _quiet(auto, "on: nothing to judge; 0 drained", sshd)
            assert _drained(backend, theirs)()
            lemon = f"{REASON} | repair: lemon (2 isolating faults)"
            slurm_cmd(cluster, "scontrol", "update", f"nodename={NODE}", f"reason={lemon}")
            _quiet(auto, "on: nothing to judge; 1 drained", sshd)
            assert _drained(backend, lemon)()
            assert _on_topic(broker.bootstrap) == []
            # The same node with trainmedic's plain reason is returned: the loop was live all along.
            slurm_cmd(cluster, "scontrol", "update", f"nodename={NODE}", f"reason={REASON}")
            wait_for(f"{NODE} resumed", lambda: not backend.node_state(NODE).drained, timeout=60)
    finally:
        store.close()


def test_max_per_hour_counts_the_returns_in_the_audit(
    broker: EmbeddedBroker,
    node: tuple[Cluster, SlurmCliBackend],
    sshd: SshServer,  # noqa: F811
    chdb_url: str,
    database: str,
    tmp_path: Path,
) -> None:
    _, backend = node
    store = _store(chdb_url, database)
    try:
        # A return the automatic path made ten minutes ago, before a restart: in the audit only.
        earlier = NodeReturn(
            event_id="ret-earlier",
            event_time=time.time() - 600,
            node="gpu03",
            incident_id="inc-auto0000",
            drain_reason="trainmedic inc-auto0000: gpu_hardware",
            operator=AUTO_OPERATOR,
            outcome="resumed",
        )
        store.insert("node_returns", [NODE_RETURNS_T.row(earlier)], NODE_RETURNS_T.column_names)
        backend.drain_node(NODE, REASON)
        policy = _policy(tmp_path, sshd, max_per_hour=1)
        with _running(broker.bootstrap, backend, store, policy, tmp_path) as auto:
            _quiet(auto, f"max_per_hour (1) nodes returned or recommended in the last hour; waiting: {NODE}", sshd)
            assert _drained(backend, REASON)() and _on_topic(broker.bootstrap) == []
            # Room for one more: returned. Drained again at once, it waits for the hour.
            _policy(tmp_path, sshd, max_per_hour=2, retry_s=1)
            wait_for(f"{NODE} resumed", lambda: not backend.node_state(NODE).drained, timeout=60)
            wait_for(f"{NODE} idle", lambda: (n := backend.node_state(NODE)).state == "IDLE" and not n.flags)
            again = "trainmedic inc-auto0002: gpu_hardware"
            backend.drain_node(NODE, again)
            _quiet(auto, f"max_per_hour (2) nodes returned or recommended in the last hour; waiting: {NODE}", sshd)
            assert _drained(backend, again)()
        assert [(e.outcome, e.operator) for e in _on_topic(broker.bootstrap)] == [("resumed", AUTO_OPERATOR)]
    finally:
        store.close()
