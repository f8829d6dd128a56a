"""SSH mode against a REAL sshd on 127.0.0.1 and the REAL local Slurm cluster.

The sshd is started by this module with test-made host and user keys (see
docs/environment.md, "Slurm on one host"); the login user is root, as on the
test machines. Every check that something did or did not happen reads the
cluster through the LOCAL Slurm CLI, independently of the SSH path under test,
and counts logins in the sshd log.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas.topics import SCHED_EVENTS
from sinks.backends.base import BackendError, SchedulerBackend
from sinks.backends.slurm_cli import SlurmCliBackend
from sinks.backends.slurm_ssh import SlurmSshBackend, SshHostKeyError, SshRunner, slurm_ssh_backend
from slurmio.runners import SlurmCommandError
from tests.conftest import Cluster, read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker

pytestmark = pytest.mark.slurm

NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
SSHD = Path("/usr/sbin/sshd")


# --------------------------------------------------------------------------- sshd
@dataclass(frozen=True)
class SshServer:
    host: str
    port: int
    user: str
    user_key: Path
    known_hosts: Path
    log: Path
    pid: int
    workdir: Path

    def logins(self) -> int:
        """Successful public-key logins so far (one per SSH connection)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return len(re.findall(r"Accepted publickey for ", text))

    def session_pids(self) -> list[int]:
        """The per-connection sshd processes (children of the listener)."""
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]


def _ensure_sshd() -> None:
    if SSHD.exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("/usr/sbin/sshd missing (install openssh-server)")
    # The CI image lacks openssh-server; as root we can add it here.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "openssh-server"]
    if subprocess.run(cmd, capture_output=True, env=env, timeout=600, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=600, check=False)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
        if proc.returncode != 0:
            pytest.fail(f"apt-get install openssh-server failed:\n{proc.stdout}\n{proc.stderr}")


def _keygen(path: Path, passphrase: str = "") -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", "trainmedic-test", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return path.with_suffix(".pub").read_text().strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _banner(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _known_hosts_line(port: int, pubkey: str) -> str:
    kind, blob = pubkey.split()[:2]
    return f"[127.0.0.1]:{port} {kind} {blob}\n"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    if os.geteuid() != 0:
        pytest.skip("the test sshd logs in as root")
    _ensure_sshd()
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir sshd insists on
    work = tmp_path_factory.mktemp("sshd")
    host_pub = _keygen(work / "host_ed25519")
    user_pub = _keygen(work / "user_ed25519")
    (work / "authorized_keys").write_text(user_pub + "\n")
    log = work / "sshd.log"
    for _attempt in range(5):  # the free port can be taken between probe and bind
        port = _free_port()
        proc = subprocess.Popen(
            [
                str(SSHD),
                "-D",
                "-f",
                "/dev/null",
                "-h",
                str(work / "host_ed25519"),
                "-p",
                str(port),
                "-E",
                str(log),
                "-o",
                "ListenAddress=127.0.0.1",
                "-o",
                f"AuthorizedKeysFile={work / 'authorized_keys'}",
                "-o",
                "PasswordAuthentication=no",
                "-o",
                "KbdInteractiveAuthentication=no",
                "-o",
                f"PidFile={work / 'sshd.pid'}",
                "-o",
                "StrictModes=no",
                "-o",
                "LogLevel=INFO",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while proc.poll() is None and not _banner(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None and _banner(port):
            break
        proc.kill()
        proc.wait(timeout=10)
    else:
        pytest.fail(f"sshd did not start:\n{log.read_text(errors='replace') if log.exists() else ''}")
    known = work / "known_hosts"
    known.write_text(_known_hosts_line(port, host_pub))
    try:
        yield SshServer("127.0.0.1", port, "root", work / "user_ed25519", known, log, proc.pid, work)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# --------------------------------------------------------------------------- cluster
def _sh(cluster: Cluster, *argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=cluster.env(), timeout=30, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@pytest.fixture
def local(slurm_cluster: Cluster) -> SlurmCliBackend:
    """Reads the cluster without SSH: the independent witness for every check."""
    return SlurmCliBackend(slurm_conf=slurm_cluster.slurm_conf)


@pytest.fixture
def clean_cluster(slurm_cluster: Cluster, local: SlurmCliBackend) -> Iterator[None]:
    def reset() -> None:
        _sh(slurm_cluster, "scancel", "--user", "root")
        for node in NODES:
            if local.node_state(node).drained:
                local.resume_node(node)
        # Generous: another test run may still be releasing nodes.
        wait_for(
            "all nodes idle",
            lambda: all(local.node_state(n).state == "IDLE" and not local.node_state(n).flags for n in NODES),
            timeout=120,
        )

    reset()
    yield
    reset()


@pytest.fixture
def ssh_backend(sshd: SshServer, slurm_cluster: Cluster) -> Iterator[SlurmSshBackend]:
    backend = slurm_ssh_backend(
        sshd.host, sshd.port, sshd.user, sshd.user_key, sshd.known_hosts, slurm_conf=slurm_cluster.slurm_conf
    )
    yield backend
    backend.close()


def _snapshot(local: SlurmCliBackend, cluster: Cluster) -> tuple[object, ...]:
    nodes = tuple((s.name, s.state, s.flags, s.reason) for s in sorted(local.list_nodes(), key=lambda s: s.name))
    jobs = _sh(cluster, "squeue", "-h", "-t", "all", "-o", "%i %T %j %k")
    return nodes, jobs


# --------------------------------------------------------------------------- tests
def test_drain_and_requeue_with_exclusion_over_ssh(
    sshd: SshServer, ssh_backend: SlurmSshBackend, local: SlurmCliBackend, clean_cluster: None
) -> None:
    assert isinstance(ssh_backend, SchedulerBackend)
    assert ssh_backend.name == "slurm-ssh"
    logins_before = sshd.logins()

    # Submitted through the SSH runner too: `sleep 600` must arrive as one word.
    out = ssh_backend.runner(
        ["sbatch", "--parsable", "--nodes=3-4", "--requeue", "--output=/dev/null", "--wrap", "sleep 600"], 30
    )
    job = out.strip().split(";")[0]  # a non-zero exit would have raised SlurmCommandError
    assert local.job_state(job).name == "wrap"

    def running_on_4() -> bool:
        js = ssh_backend.job_state(job)
        return js.state == "RUNNING" and len(js.nodes) == 4

    wait_for(f"job {job} RUNNING on 4 nodes", running_on_4, timeout=120)

    reason = "trainmedic test: xid 79 on GPU 3 (via ssh)"
    ssh_backend.drain_node("gpu02", reason)
    ssh_backend.requeue_job(job, ["gpu02"])

    def running_again() -> bool:
        js = ssh_backend.job_state(job)
        return js.state == "RUNNING" and js.restart_count >= 1

    wait_for("requeued job RUNNING again", running_again, timeout=120)

    node = local.node_state("gpu02")
    assert node.drained and node.reason == reason
    js = local.job_state(job)
    assert js.state == "RUNNING"
    assert "gpu02" not in js.nodes and len(js.nodes) == 3
    assert "gpu02" in js.excluded_nodes
    assert js.restart_count >= 1
    # Dozens of commands, one SSH session.
    assert ssh_backend.runner.connections_opened == 1
    assert sshd.logins() - logins_before == 1


@pytest.mark.parametrize("case", ["other-key", "no-entry", "empty"])
def test_wrong_host_key_refuses_and_runs_nothing(
    case: str,
    sshd: SshServer,
    slurm_cluster: Cluster,
    local: SlurmCliBackend,
    clean_cluster: None,
    tmp_path: Path,
) -> None:
    known = tmp_path / "known_hosts"
    if case == "other-key":
        known.write_text(_known_hosts_line(sshd.port, _keygen(tmp_path / "impostor")))
    elif case == "no-entry":
        # The right key, but filed under another port: entries are per host:port.
        right = sshd.known_hosts.read_text().split(" ", 1)[1]
        known.write_text(f"[127.0.0.1]:{sshd.port + 1 if sshd.port < 65535 else 1} {right}")
    else:
        known.write_text("")
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    before = _snapshot(local, slurm_cluster)
    logins_before = sshd.logins()

    backend = slurm_ssh_backend(
        sshd.host, sshd.port, sshd.user, sshd.user_key, known, slurm_conf=slurm_cluster.slurm_conf
    )
    try:
        with pytest.raises(SshHostKeyError) as err:
            backend.drain_node("gpu01", "must never be applied")
        message = str(err.value)
        assert "127.0.0.1" in message and str(sshd.port) in message
        assert str(known) in message
        assert "nothing was run" in message
        with pytest.raises(SshHostKeyError):
            backend.runner(["sbatch", "--wrap", f"touch {marker}"], 30)
        with pytest.raises(SshHostKeyError):
            backend.list_nodes()
        assert backend.runner.connections_opened == 0
    finally:
        backend.close()

    # Host-key checking happens before authentication: no login, so no command.
    assert sshd.logins() == logins_before
    assert _snapshot(local, slurm_cluster) == before
    assert not local.node_state("gpu01").drained
    assert not marker.exists()


def test_shell_metacharacters_are_rejected_or_literal(
    sshd: SshServer,
    ssh_backend: SlurmSshBackend,
    slurm_cluster: Cluster,
    local: SlurmCliBackend,
    clean_cluster: None,
) -> None:
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    injections = (
        f"gpu01; touch {marker}",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"gpu01 && touch {marker}",
        f"gpu01 | touch {marker}",
        f"gpu01\ntouch {marker}",
        f"'; touch {marker}; '",
    )
    try:
        # 1. Through the backend: node names are validated before any command exists.
        for bad in injections:
            with pytest.raises(ValueError, match="invalid node name"):
                ssh_backend.drain_node(bad, "x")
            with pytest.raises(ValueError, match="invalid node name"):
                ssh_backend.requeue_job("1", [bad])

        # 2. Straight into the runner: each value reaches scontrol as ONE literal word.
        for bad in injections:
            with pytest.raises(SlurmCommandError) as failed:
                ssh_backend.runner(["scontrol", "show", "node", bad], 30)
            assert failed.value.returncode not in (None, 0)  # no such node: the whole string was the name
            assert not marker.exists(), f"shell ran {bad!r}"

        # 3. A reason may hold metacharacters; it must be stored verbatim.
        reason = f"x; touch {marker} $(touch {marker}) `touch {marker}` | & > < * ? ~ $HOME \\ end"
        ssh_backend.drain_node("gpu01", reason)
        assert local.node_state("gpu01").reason == reason
        assert not marker.exists()

        # 4. Only the Slurm binaries may be named as the command.
        for argv in (
            ["touch", str(marker)],
            ["sh", "-c", f"touch {marker}"],
            [f"scontrol; touch {marker}"],
            ["/usr/bin/scontrol"],
            ["env", "scontrol"],
        ):
            with pytest.raises(ValueError, match="refusing to run"):
                ssh_backend.runner(argv, 30)

        # 5. SLURM_CONF is quoted too: a config folder whose path is full of
        # metacharacters (a link to the real one) must work as-is.
        odd = Path(f"/tmp/tm-ssh-{uuid.uuid4().hex[:8]}/etc; touch {marker} `touch {marker}` $(touch {marker})")
        odd.parent.mkdir(parents=True)
        odd.symlink_to(Path(slurm_cluster.slurm_conf).parent, target_is_directory=True)
        try:
            runner = SshRunner(
                sshd.host, sshd.port, sshd.user, sshd.user_key, sshd.known_hosts, slurm_conf=f"{odd}/slurm.conf"
            )
            with runner:
                out = runner(["sinfo", "-h", "-N", "-o", "%N"], 30)
            assert set(out.split()) >= set(NODES)
        finally:
            shutil.rmtree(Path("/tmp") / odd.relative_to("/tmp").parts[0])
    finally:
        pwned = marker.exists()
        marker.unlink(missing_ok=True)
    assert not pwned
    assert local.node_state("gpu02").reason is None  # nothing else was touched


def test_one_connection_is_reused_and_reestablished(sshd: SshServer, ssh_backend: SlurmSshBackend) -> None:
    runner = ssh_backend.runner
    logins_before = sshd.logins()
    for _ in range(3):
        assert len(ssh_backend.list_nodes()) >= 4
        assert ssh_backend.node_state("gpu03").name == "gpu03"
        assert set(runner(["sinfo", "-h", "-N", "-o", "%N"], 30).split()) >= set(NODES)
    assert runner.connections_opened == 1
    assert sshd.logins() - logins_before == 1

    # Cut the link from the server side: kill the session's sshd process.
    sessions = sshd.session_pids()
    assert sessions, "no sshd session process for the open connection"
    for pid in sessions:
        os.kill(pid, signal.SIGTERM)
    wait_for("sshd session gone", lambda: not set(sessions) & set(sshd.session_pids()), timeout=30)

    assert len(ssh_backend.list_nodes()) >= 4  # reconnects instead of failing
    assert runner.connections_opened == 2
    for _ in range(3):
        assert ssh_backend.node_state("gpu01").name == "gpu01"
    assert runner.connections_opened == 2
    assert sshd.logins() - logins_before == 2

    # Again, but call at once: the client may not have seen the close yet, and
    # then the channel open fails; the command was never sent, so it is retried.
    sessions = sshd.session_pids()
    for pid in sessions:
        os.kill(pid, signal.SIGKILL)
    assert ssh_backend.node_state("gpu04").name == "gpu04"
    assert runner.connections_opened == 3


def test_unreachable_server_is_a_clear_backend_error(sshd: SshServer) -> None:
    port = _free_port()  # nothing listens there
    known = sshd.workdir / "known_hosts_unreachable"
    known.write_text(sshd.known_hosts.read_text().replace(f":{sshd.port} ", f":{port} "))
    with (
        SshRunner("127.0.0.1", port, "root", sshd.user_key, known, connect_timeout=5) as runner,
        pytest.raises(BackendError, match=rf"root@127\.0\.0\.1:{port}.*nothing was run"),
    ):
        runner(["sinfo"], 10)
    assert runner.connections_opened == 0


def test_secrets_never_logged(sshd: SshServer, slurm_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    passphrase = f"pp-{uuid.uuid4().hex}"
    key = sshd.workdir / f"enc_{uuid.uuid4().hex[:8]}"
    pub = _keygen(key, passphrase)
    with (sshd.workdir / "authorized_keys").open("a") as f:
        f.write(pub + "\n")
    key_text = key.read_text()
    key_body = "".join(line for line in key_text.splitlines() if not line.startswith("-----"))

    caplog.set_level(logging.DEBUG)
    with pytest.raises(ValueError, match="cannot load SSH private key") as err:
        SshRunner(sshd.host, sshd.port, "root", key, sshd.known_hosts, passphrase="wrong-" + passphrase)
    assert passphrase not in str(err.value)
    backend = slurm_ssh_backend(
        sshd.host,
        sshd.port,
        "root",
        key,
        sshd.known_hosts,
        slurm_conf=slurm_cluster.slurm_conf,
        passphrase=passphrase,
    )
    try:
        assert len(backend.list_nodes()) >= 4
    finally:
        backend.close()
    shown = caplog.text + repr(backend.runner) + repr(vars(backend.runner))
    assert passphrase not in shown
    for chunk in (key_body[i : i + 24] for i in range(0, len(key_body), 24)):
        assert chunk not in shown


def test_remote_command_quotes_every_word(sshd: SshServer) -> None:
    runner = SshRunner(
        sshd.host, sshd.port, "root", sshd.user_key, sshd.known_hosts, slurm_conf="/etc/slurm dir/slurm.conf"
    )
    cmd = runner.remote_command(["scontrol", "update", "NodeName=gpu01", "Reason=a b; $(c) `d`"])
    assert cmd == (
        "env LC_ALL=C 'SLURM_CONF=/etc/slurm dir/slurm.conf' scontrol update NodeName=gpu01 'Reason=a b; $(c) `d`'"
    )
    no_conf = SshRunner(sshd.host, sshd.port, "root", sshd.user_key, sshd.known_hosts)
    assert no_conf.remote_command(["squeue", "--json"]) == "env LC_ALL=C squeue --json"
    runner.close()
    no_conf.close()


def test_the_slurm_producer_polls_over_ssh_as_the_settings_say(
    sshd: SshServer, slurm_cluster: Cluster, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """`produce slurm` with slurm_access ssh (the chart's ssh mode): squeue/sinfo run on the login
    node, the producer gets ready and publishes; slurmrestd access is refused naming the setting."""
    import sys

    from tests.launch import running
    from trainmedic.stack.broker import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_") and k != "SLURM_CONF"}
    env |= {
        "TRAINMEDIC_BOOTSTRAP": broker.bootstrap,
        "TRAINMEDIC_SLURM_ACCESS": "ssh",
        "TRAINMEDIC_SLURM_SSH_HOST": sshd.host,
        "TRAINMEDIC_SLURM_SSH_PORT": str(sshd.port),
        "TRAINMEDIC_SLURM_SSH_USER": sshd.user,
        "TRAINMEDIC_SLURM_SSH_KEY": str(sshd.user_key),
        "TRAINMEDIC_SLURM_SSH_KNOWN_HOSTS": str(sshd.known_hosts),
        "TRAINMEDIC_SLURM_SSH_SLURM_CONF": slurm_cluster.slurm_conf,
        "TRAINMEDIC_METRICS_HOST": "127.0.0.1",
        "TRAINMEDIC_METRICS_PORT": str(port := free_port()),
    }
    tm = str(Path(sys.executable).with_name("trainmedic"))
    argv = [tm, "produce", "slurm", "--interval", "1", "--state-file", str(tmp_path / "state.json")]
    before = sshd.logins()
    with running(argv, env, tmp_path / "slurm.log", f"http://127.0.0.1:{port}/readyz", timeout=90):
        wait_for("a snapshot marker on sched.events", lambda: read_topic(broker.bootstrap, SCHED_EVENTS.name, 2.0))
    assert sshd.logins() > before  # the polls went over SSH
    refused = subprocess.run(
        [tm, "produce", "slurm"], env=env | {"TRAINMEDIC_SLURM_ACCESS": "rest"}, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "slurm_access" in refused.stderr
