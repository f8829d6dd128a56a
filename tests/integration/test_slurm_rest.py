"""The slurmrestd backend against a real slurmrestd 24.11 (infra/slurm/slurmrestd.sh), JWT auth.

slurmrestd runs as its own non-root user on 127.0.0.1 in front of the 24.11 cluster of
start-2411.sh; every effect is checked through the cluster's own CLI (slurm-cli backend),
an independent witness. What the API can do is verified done; what it cannot (requeue of a
running job, with or without excluded nodes; hold of a running job) is refused with the gap
named, and the witness shows nothing changed.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from schemas.events import Action
from sinks.backends.base import ActionRefused, BackendError, NotPermitted, SchedulerBackend
from sinks.backends.slurm_cli import JobNotFoundError, SlurmCliBackend
from sinks.backends.slurm_rest import RestApiGap, SlurmRestBackend, TokenSource, load_api_catalog
from sinks.executor import Executor, ExecutorSettings
from tests.conftest import Cluster, wait_for
from tests.parallel import cluster_script_lock

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SLURMRESTD_SH = REPO / "infra" / "slurm" / "slurmrestd.sh"
NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
GONE = ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")


@pytest.fixture(scope="module")
def rest_env(slurm2411_cluster: Cluster) -> dict[str, str]:
    # Under the cluster's script lock: slurmrestd.sh runs start-2411.sh (and may restart slurmctld),
    # which another test worker's fixture may be running at the same moment.
    with cluster_script_lock(slurm2411_cluster.state_dir):
        proc = subprocess.run(
            ["bash", str(SLURMRESTD_SH), "start"], capture_output=True, text=True, timeout=600, check=False
        )
    if proc.returncode != 0:
        pytest.fail(f"slurmrestd.sh start failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    env_sh = slurm2411_cluster.state_dir / "rest" / "env.sh"
    env = dict(tok.split("=", 1) for tok in shlex.split(env_sh.read_text(), comments=True) if "=" in tok)
    return env


@pytest.fixture
def rest(rest_env: dict[str, str]) -> Iterator[SlurmRestBackend]:
    backend = SlurmRestBackend(
        rest_env["TRAINMEDIC_SLURMRESTD_URL"],
        rest_env["TRAINMEDIC_SLURMRESTD_USER"],
        TokenSource(file=Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"])),
    )
    yield backend
    backend.close()


@pytest.fixture
def witness(slurm2411_cluster: Cluster) -> Iterator[SlurmCliBackend]:
    """The 24.11 cluster through its CLI; nodes clean before and after, our jobs cancelled after."""
    cli = SlurmCliBackend(slurm2411_cluster.runner())

    def reset() -> None:
        for node in NODES:
            state = cli.node_state(node)
            if state.drained or state.state == "DOWN":
                cli.resume_node(node)
        wait_for(
            "all 24.11 nodes idle",
            lambda: all(_clean(cli, n) for n in NODES),
            timeout=60,
        )

    reset()
    yield cli
    reset()


@pytest.fixture
def submit(slurm2411_cluster: Cluster, witness: SlurmCliBackend) -> Iterator[Callable[..., str]]:
    submitted: list[str] = []

    def _submit(*args: str) -> str:
        proc = subprocess.run(
            ["sbatch", "--parsable", "--output=/dev/null", "--requeue", *args, "--wrap", "sleep 300"],
            capture_output=True,
            text=True,
            env=slurm2411_cluster.env(),
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().split(";")[0]
        submitted.append(job_id)
        return job_id

    yield _submit
    for job_id in submitted:
        try:
            if witness.job_state(job_id).state not in GONE:
                witness.cancel_job(job_id)
        except BackendError:
            pass


def _clean(witness: SlurmCliBackend, node: str) -> bool:
    # After a resume 24.11 shows the node NOT_RESPONDING until slurmd answers its next ping.
    s = witness.node_state(node)
    return s.state == "IDLE" and not s.flags


def _running(witness: SlurmCliBackend, job_id: str) -> bool:
    return witness.job_state(job_id).state == "RUNNING"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_slurmrestd_runs_as_its_own_user(slurm2411_cluster: Cluster, rest_env: dict[str, str]) -> None:
    pid = (slurm2411_cluster.state_dir / "data" / "run" / "slurmrestd.pid").read_text().strip()
    status = Path(f"/proc/{pid}/status").read_text()
    assert "slurmrestd" in Path(f"/proc/{pid}/comm").read_text()
    uids = {int(u) for u in next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]}
    assert 0 not in uids  # it refuses root; and no uid a host user has
    host_uids = {int(ln.split(":")[2]) for ln in Path("/etc/passwd").read_text().splitlines() if ln.count(":") >= 2}
    assert not uids & host_uids


def test_backend_implements_protocol_and_uses_the_highest_api(rest: SlurmRestBackend) -> None:
    assert isinstance(rest, SchedulerBackend)
    # 24.11's slurmrestd serves v0.0.40, v0.0.41 and v0.0.42: the highest is taken.
    assert rest.version == "v0.0.42"
    caps = rest.capabilities()
    assert caps["drain_node"].startswith("yes: POST /slurm/v0.0.42/node/")
    assert caps["requeue_running"].startswith("no: slurmrestd v0.0.42 has no requeue")
    assert caps["hold_running"].startswith("no: ")


def test_capabilities_and_gaps_are_logged_at_start(rest_env: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainmedic.backend.slurm_rest"):
        SlurmRestBackend(
            rest_env["TRAINMEDIC_SLURMRESTD_URL"],
            "root",
            TokenSource(file=Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"])),
        ).close()
    text = caplog.text
    assert "API v0.0.42" in text and "can: " in text
    assert "cannot: hold_running" in text and "requeue_running (slurmrestd v0.0.42 has no requeue" in text


def test_drain_is_verified_by_the_cli_then_resume(rest: SlurmRestBackend, witness: SlurmCliBackend) -> None:
    rest.drain_node("gpu03", "trainmedic inc-rest-1: xid 79")
    seen = witness.node_state("gpu03")
    assert seen.drained and seen.reason == "trainmedic inc-rest-1: xid 79"
    mine = rest.node_state("gpu03")
    assert mine.drained and mine.reason == seen.reason
    assert {n.name for n in rest.list_nodes()} >= set(NODES)
    rest.resume_node("gpu03")
    wait_for("gpu03 undrained", lambda: not witness.node_state("gpu03").drained, timeout=30)


def test_requeue_of_a_running_job_is_refused_naming_the_gap(
    rest: SlurmRestBackend, witness: SlurmCliBackend, submit: Callable[..., str]
) -> None:
    job = submit("-N1")
    wait_for(f"job {job} RUNNING", lambda: _running(witness, job), timeout=60)
    node = witness.job_state(job).nodes[0]
    for exclude in ([node], []):
        with pytest.raises(RestApiGap, match=r"has no requeue.*'excluded_nodes' on a RUNNING job is refused"):
            rest.requeue_job(job, exclude)
    after = witness.job_state(job)
    # Nothing was changed: still running where it was, never restarted, nothing excluded.
    assert (after.state, after.nodes, after.restart_count, after.excluded_nodes) == ("RUNNING", (node,), 0, ())


def test_exclusion_on_a_pending_job_steers_where_it_runs(
    rest: SlurmRestBackend, witness: SlurmCliBackend, submit: Callable[..., str]
) -> None:
    """What the API can do of requeue-with-exclusion: narrow a queued job's nodes (kept merged)."""
    job = submit("-N1", "--hold")
    assert witness.job_state(job).state == "PENDING"
    rest.requeue_job(job, ["gpu01", "gpu02"])
    rest.requeue_job(job, ["gpu03"])  # earlier exclusions are kept
    assert set(witness.job_state(job).excluded_nodes) == {"gpu01", "gpu02", "gpu03"}
    rest.release_job(job)
    wait_for(f"job {job} RUNNING", lambda: _running(witness, job), timeout=60)
    assert witness.job_state(job).nodes == ("gpu04",)


def test_hold_release_and_cancel(rest: SlurmRestBackend, witness: SlurmCliBackend, submit: Callable[..., str]) -> None:
    pending = submit("-N1", "--begin=now+1hour")
    rest.hold_job(pending)
    assert witness.job_state(pending).held
    rest.release_job(pending)
    assert not witness.job_state(pending).held

    job = submit("-N1")
    wait_for(f"job {job} RUNNING", lambda: _running(witness, job), timeout=60)
    with pytest.raises(RestApiGap, match="cannot stop a running job and keep it"):
        rest.hold_job(job)
    assert not witness.job_state(job).held  # refused before any change
    rest.annotate_job(job, "trainmedic act-rest restarts=0")
    assert witness.job_state(job).comment == "trainmedic act-rest restarts=0"
    rest.cancel_job(job)
    wait_for(f"job {job} cancelled", lambda: witness.job_state(job).state in GONE, timeout=30)
    assert rest.job_state(job).state == witness.job_state(job).state
    with pytest.raises(JobNotFoundError):
        rest.cancel_job("999999")


def test_executor_drains_and_reports_the_requeue_gap(
    rest: SlurmRestBackend, witness: SlurmCliBackend, submit: Callable[..., str]
) -> None:
    """drain_and_requeue through slurmrestd: the drain is done and verified, the requeue fails
    with the gap in the result; the job is left running (nothing pretended)."""
    job = submit("-N1")
    wait_for(f"job {job} RUNNING", lambda: _running(witness, job), timeout=60)
    node = witness.job_state(job).nodes[0]
    action = Action(
        event_id="act-rest-1",
        event_time=1.0,
        action_id="act-rest-1",
        decision_id="dec-rest-1",
        incident_id="inc-rest-1",
        job_id=job,
        node=node,
        partition="gpu",
        action="drain_and_requeue",
        reason="trainmedic inc-rest-1: xid 79",
        requested_by="policy",
        incident_time=1.0,
        first_signal_time=0.5,
    )
    result = Executor(rest, ExecutorSettings(verify_timeout_s=20)).execute(action, lambda a, call: None)
    assert result.status == "failed" and result.backend == "slurm-rest"
    assert result.error is not None and "has no requeue" in result.error
    assert any(s.startswith(f"drain {node}: verified DRAIN") for s in result.steps)
    assert witness.node_state(node).drained
    after = witness.job_state(job)
    assert after.state == "RUNNING" and after.restart_count == 0


def test_bad_token_is_refused_clearly(rest_env: dict[str, str], tmp_path: Path, witness: SlurmCliBackend) -> None:
    url = rest_env["TRAINMEDIC_SLURMRESTD_URL"]
    good = Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"]).read_text().strip()
    bad = tmp_path / "token"
    bad.write_text(good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB") + "\n")
    with pytest.raises(BackendError, match="refused"):
        SlurmRestBackend(url, "root", TokenSource(file=bad))
    # A token that goes bad after start (rotated away, expired): refused per call, nothing done.
    live = tmp_path / "live"
    live.write_text(good)
    backend = SlurmRestBackend(url, "root", TokenSource(file=live))
    live.write_text("not-a-jwt")
    with pytest.raises(BackendError, match="refused the token"):
        backend.drain_node("gpu02", "trainmedic inc-rest-2: must not happen")
    assert not witness.node_state("gpu02").drained
    live.write_text("")
    with pytest.raises(BackendError, match="empty or not a single-line token"):
        backend.node_state("gpu02")


def test_token_from_environment(rest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    token = Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"]).read_text()
    monkeypatch.setenv("TEST_SLURM_JWT", token)
    backend = SlurmRestBackend(rest_env["TRAINMEDIC_SLURMRESTD_URL"], "root", TokenSource(env="TEST_SLURM_JWT"))
    assert backend.node_state("gpu01").name == "gpu01"
    monkeypatch.delenv("TEST_SLURM_JWT")
    with pytest.raises(BackendError, match="environment variable TEST_SLURM_JWT"):
        backend.node_state("gpu01")


class Forwarder:
    """A TCP forwarder on a free loopback port to the real slurmrestd; stop() takes it away."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        # shutdown() first: close() alone does not end a recv() blocked in another thread.
        for sock in (self.listener, *self.open):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_server_down_fails_closed(rest_env: dict[str, str], witness: SlurmCliBackend) -> None:
    token = TokenSource(file=Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"]))
    with pytest.raises(BackendError, match="unreachable"):
        SlurmRestBackend(f"http://127.0.0.1:{_free_port()}", "root", token, timeout=3)
    # Started while the server answered, then the server is gone: every call fails, nothing is assumed done.
    forwarder = Forwarder(rest_env["TRAINMEDIC_SLURMRESTD_URL"])
    backend = SlurmRestBackend(forwarder.url, "root", token, timeout=3)
    assert backend.node_state("gpu02").name == "gpu02"
    forwarder.stop()
    for call in (
        lambda: backend.drain_node("gpu02", "trainmedic inc-rest-3: x"),
        lambda: backend.node_state("gpu02"),
        lambda: backend.job_state("1"),
        lambda: backend.cancel_job("1"),
    ):
        with pytest.raises(BackendError, match="unreachable|timed out"):
            call()
    assert not witness.node_state("gpu02").drained


def test_plain_http_to_a_remote_host_and_bad_input_are_refused(rest_env: dict[str, str]) -> None:
    token = TokenSource(file=Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"]))
    with pytest.raises(ValueError, match="token in clear"):
        SlurmRestBackend("http://slurm.example.org:6820", "root", token)
    with pytest.raises(ValueError, match="exactly one"):
        TokenSource()
    rest = SlurmRestBackend(rest_env["TRAINMEDIC_SLURMRESTD_URL"], "root", token)
    with pytest.raises(ValueError, match="invalid node name"):
        rest.drain_node("gpu01/../x", "r")
    with pytest.raises(ValueError, match="digits only"):
        rest.cancel_job("1;2")


def test_api_catalog_names_every_operation_once() -> None:
    catalog = load_api_catalog()
    assert set(catalog.gaps) == {"requeue_running", "hold_running"}
    assert not set(catalog.how) & set(catalog.gaps)
    assert catalog.versions == ("v0.0.40", "v0.0.41", "v0.0.42")


def test_cli_chooses_the_rest_backend(rest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas.errors import UsageError
    from trainmedic.cli.backend import scheduler_backend as _backend

    token_file = Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"])
    chosen = _backend("slurm-rest", rest=(rest_env["TRAINMEDIC_SLURMRESTD_URL"], "root", token_file))
    assert isinstance(chosen, SlurmRestBackend) and chosen.version == "v0.0.42"
    monkeypatch.setenv("TRAINMEDIC_SLURMRESTD_TOKEN", token_file.read_text())
    assert _backend("slurm-rest", rest=(rest_env["TRAINMEDIC_SLURMRESTD_URL"], "root", None)).name == "slurm-rest"
    monkeypatch.delenv("TRAINMEDIC_SLURMRESTD_TOKEN")
    for rest in ((None, "root", token_file), (rest_env["TRAINMEDIC_SLURMRESTD_URL"], "root", None)):
        with pytest.raises(UsageError):
            _backend("slurm-rest", rest=rest)


@pytest.mark.parametrize("version", ["v0.0.40", "v0.0.41"])
def test_older_api_versions_served_by_2411(
    version: str, rest_env: dict[str, str], witness: SlurmCliBackend, submit: Callable[..., str]
) -> None:
    """24.11 also serves v0.0.40 (23.11's) and v0.0.41 (24.05's): real replies of those data parsers."""
    backend = SlurmRestBackend(
        rest_env["TRAINMEDIC_SLURMRESTD_URL"],
        "root",
        TokenSource(file=Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_FILE"])),
        api_version=version,
    )
    assert backend.capabilities()["requeue_running"].startswith(f"no: slurmrestd {version} has no requeue")
    backend.drain_node("gpu02", f"trainmedic inc-{version}: x")
    assert witness.node_state("gpu02").reason == f"trainmedic inc-{version}: x"
    assert backend.node_state("gpu02").drained
    backend.resume_node("gpu02")
    wait_for("gpu02 idle again", lambda: _clean(witness, "gpu02"), timeout=30)
    job = submit("-N1", "--hold")
    backend.requeue_job(job, ["gpu01"])
    assert witness.job_state(job).excluded_nodes == ("gpu01",)
    mine = backend.job_state(job)
    assert (mine.state, mine.held, mine.excluded_nodes) == ("PENDING", True, ("gpu01",))
    backend.cancel_job(job)
    wait_for(f"job {job} cancelled", lambda: witness.job_state(job).state == "CANCELLED", timeout=30)


def _as_user(rest_env: dict[str, str], user: str) -> SlurmRestBackend:
    token = Path(rest_env["TRAINMEDIC_SLURMRESTD_TOKEN_DIR"]) / f"token-{user}"
    assert token.is_file(), f"slurmrestd.sh made no token for {user} (start-2411.sh's accounting users)"
    return SlurmRestBackend(rest_env["TRAINMEDIC_SLURMRESTD_URL"], user, TokenSource(file=token))


def test_non_root_users_get_exactly_their_rights(
    rest_env: dict[str, str], witness: SlurmCliBackend, submit: Callable[..., str]
) -> None:
    """The JWT's user is who slurmctld checks: Administrator tmexec drains; Operator tmop and
    plain tmuser are refused the drain (UPDATE_NODE needs a super user) and change nothing."""
    admin = _as_user(rest_env, "tmexec")
    admin.drain_node("gpu04", "trainmedic inc-rest-admin: x")
    seen = witness.node_state("gpu04")
    assert seen.drained and seen.reason == "trainmedic inc-rest-admin: x"
    admin.resume_node("gpu04")
    wait_for("gpu04 idle again", lambda: _clean(witness, "gpu04"), timeout=30)
    job = submit("-N1", "--hold")  # root's job
    for user in ("tmop", "tmuser"):
        backend = _as_user(rest_env, user)
        with pytest.raises(NotPermitted, match=rf"node/gpu04: HTTP 500: .*Invalid user id.*to user '{user}'"):
            backend.drain_node("gpu04", f"trainmedic inc-rest-{user}: must not happen")
        assert not witness.node_state("gpu04").drained
        if user == "tmuser":  # not even Operator: another user's job is not its to cancel
            with pytest.raises(NotPermitted):
                backend.cancel_job(job)
            assert witness.job_state(job).state == "PENDING"


def test_someone_elses_drain_and_maintenance_are_left_alone(
    slurm2411_cluster: Cluster, rest: SlurmRestBackend, witness: SlurmCliBackend
) -> None:
    """As the CLI backend: never overwrite another's drain, never act in a MAINT reservation."""
    witness.drain_node("gpu03", "admin: bad fan")
    with pytest.raises(ActionRefused, match="already drained"):
        rest.drain_node("gpu03", "trainmedic inc-rest-4: x")
    assert witness.node_state("gpu03").reason == "admin: bad fan"

    def scontrol(*args: str) -> None:
        proc = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, env=slurm2411_cluster.env(), timeout=30, check=False
        )
        assert proc.returncode == 0, proc.stderr

    name = "tm_rest_maint"
    scontrol("create", "reservation", f"ReservationName={name}", "StartTime=now", "Duration=5", "Nodes=gpu01",
             "Users=root", "Flags=MAINT")  # fmt: skip
    try:
        assert rest.maintenance_reservation("gpu01") == name
        assert rest.maintenance_reservation("gpu02") is None
        with pytest.raises(ActionRefused, match=f"maintenance reservation {name}"):
            rest.drain_node("gpu01", "trainmedic inc-rest-5: x")
        assert not witness.node_state("gpu01").drained
    finally:
        scontrol("delete", f"ReservationName={name}")
