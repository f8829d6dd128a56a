"""Shared fixtures: the real embedded broker, one chDB folder per test session
(chDB allows one folder per process: tests use separate databases inside it),
and the real local Slurm clusters from infra/slurm.

The suite runs in parallel under pytest-xdist (`make test`). Each worker is its own session,
so session fixtures run once per worker; the two Slurm clusters are the exception that
must stay one per machine: see `tests/parallel.py` for how their tests are grouped, locked
and started once.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import settings as hypothesis_settings

from bus.admin import ensure_topics
from bus.config import configure_session_timeout
from trainmedic.stack.broker import EmbeddedBroker

# Every consumer group join on the embedded broker takes about half the session timeout, and the
# suite starts a few hundred groups (each worker, executor and sink, each restart). Tests run on the
# embedded broker only, which has no floor for it (Kafka's default floor, 6000 ms, stays the default):
# 3000 ms halves each join; heartbeats every second still leave three to miss before an eviction.
# Processes the tests start inherit it; those that must not (a clean environment) keep the default.
TEST_SESSION_TIMEOUT_MS = 3000
os.environ.setdefault("TRAINMEDIC_KAFKA_SESSION_TIMEOUT_MS", str(TEST_SESSION_TIMEOUT_MS))
configure_session_timeout(int(os.environ["TRAINMEDIC_KAFKA_SESSION_TIMEOUT_MS"]))

# Property tests check behaviour, not speed: no per-example deadline (on a loaded 2-core CI machine
# one slow example failed an otherwise passing run), and a fixed example sequence per test, so a
# run's outcome does not depend on chance; a finding is still printed with its failing example.
hypothesis_settings.register_profile("suite", deadline=None, derandomize=True)
hypothesis_settings.load_profile("suite")

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.parallel", "tests.budget", "pytester"]
FIXTURES = REPO / "tests" / "fixtures"
START = REPO / "infra" / "slurm" / "start.sh"
STOP = REPO / "infra" / "slurm" / "stop.sh"
START_2411 = REPO / "infra" / "slurm" / "start-2411.sh"
STOP_2411 = REPO / "infra" / "slurm" / "stop-2411.sh"
_db_counter = itertools.count(1)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2) -> Any:
    """Poll until probe returns something truthy; fail the test naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def broker() -> Iterator[EmbeddedBroker]:
    """A fresh Tansu broker per test: memory-only, so tests cannot see each other's events. It costs
    0.12 s to start with its topics; stopped gracefully after a stack has used it, Tansu takes 5 s
    to exit, so the test's broker is killed: nothing of its state is wanted after the test."""
    b = EmbeddedBroker().start()
    ensure_topics(b.bootstrap)
    yield b
    b.stop(grace_s=0)


@pytest.fixture(scope="session")
def chdb_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"chdb://{tmp_path_factory.mktemp('chdb')}"


def new_database_name() -> str:
    """A database name no other test of this run uses (the pid tells the xdist workers apart). A
    module's read-only fixture seeds one once for all its tests, instead of a migration and the same
    inserts per test."""
    return f"t{os.getpid()}_{next(_db_counter)}"


@pytest.fixture
def database() -> str:
    return new_database_name()


@dataclass(frozen=True)
class SshLogin:
    """A login node of a test cluster: where to SSH and with which keys."""

    host: str
    port: int
    user: str
    key: Path
    known_hosts: Path


@dataclass(frozen=True)
class Cluster:
    slurm_conf: str
    state_dir: Path
    version: str = "22.05"
    # 24.11 runs in a trixie root: its clients are wrappers in bin_dir, put first on PATH.
    bin_dir: Path | None = None
    login: SshLogin | None = None

    def env(self) -> dict[str, str]:
        path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        return {
            "PATH": f"{self.bin_dir}:{path}" if self.bin_dir else path,
            "LC_ALL": "C",
            "SLURM_CONF": self.slurm_conf,
        }

    def runner(self) -> Any:
        """A slurmio LocalRunner that talks to this cluster."""
        from slurmio.runners import LocalRunner

        return LocalRunner(self.slurm_conf, path=self.env()["PATH"])


def _slurm_installed() -> bool:
    return all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in ("slurmctld", "slurmd", "sbatch", "munged"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        reason = "needs root to run a local Slurm cluster (SlurmUser=root, mknod)"
        if not _slurm_installed():
            reason += "; slurmctld/slurmd/slurm-client/munge are not installed either"
        pytest.skip(reason)
    from tests.parallel import start_cluster_once, stop_here

    state_dir = Path(os.environ.get("TRAINMEDIC_SLURM_DIR", "/tmp/trainmedic-slurm"))
    t0 = time.monotonic()
    proc = start_cluster_once(state_dir, ["bash", str(START)], ["bash", str(STOP)], timeout=600)
    startup_s = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(f"infra/slurm/start.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    print(f"\n[slurm] {proc.stdout.strip()} (start.sh took {startup_s:.2f}s)")
    started_here = stop_here(proc.stdout)
    slurm_conf = ""
    for token in shlex.split((state_dir / "env.sh").read_text()):
        if token.startswith("SLURM_CONF="):
            slurm_conf = token.split("=", 1)[1]
    assert slurm_conf and Path(slurm_conf).is_file(), "env.sh has no SLURM_CONF"
    yield Cluster(slurm_conf=slurm_conf, state_dir=state_dir)
    if started_here and not os.environ.get("TRAINMEDIC_SLURM_KEEP"):
        subprocess.run(["bash", str(STOP)], capture_output=True, timeout=120, check=False)


@pytest.fixture(scope="session")
def slurm2411_cluster() -> Iterator[Cluster]:
    """A real Slurm 24.11 (Debian trixie root, infra/slurm/start-2411.sh) beside the 22.05 one.

    The first run builds the root with debootstrap (about a minute, needs the
    Debian mirror of this machine's apt sources); later runs start in seconds,
    and a running cluster is left alone (the script is idempotent).
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to run the Slurm 24.11 root (chroot, mount namespace, mknod)")
    from tests.parallel import start_cluster_once, stop_here

    state_dir = Path(os.environ.get("TRAINMEDIC_SLURM2411_DIR", "/tmp/trainmedic-slurm2411"))
    t0 = time.monotonic()
    proc = start_cluster_once(state_dir, ["bash", str(START_2411)], ["bash", str(STOP_2411)], timeout=900)
    startup_s = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(f"infra/slurm/start-2411.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    print(f"\n[slurm 24.11] {proc.stdout.strip()} (start-2411.sh took {startup_s:.2f}s)")
    started_here = stop_here(proc.stdout)
    env: dict[str, str] = {}
    for token in shlex.split((state_dir / "env.sh").read_text(), comments=True):
        if "=" in token and not token.startswith("PATH="):
            key, value = token.split("=", 1)
            env[key] = value
    conf, bin_dir = env.get("SLURM_CONF", ""), env.get("TRAINMEDIC_SLURM2411_BIN", "")
    assert conf and Path(conf).is_file() and bin_dir, f"{state_dir}/env.sh lacks SLURM_CONF / TRAINMEDIC_SLURM2411_BIN"
    user_host, port = env["TRAINMEDIC_SLURM2411_SSH"].rsplit(":", 1)
    user, host = user_host.split("@", 1)
    login = SshLogin(
        host, int(port), user, Path(env["TRAINMEDIC_SLURM2411_SSH_KEY"]), Path(env["TRAINMEDIC_SLURM2411_KNOWN_HOSTS"])
    )
    yield Cluster(slurm_conf=conf, state_dir=state_dir, version="24.11", bin_dir=Path(bin_dir), login=login)
    if started_here and not os.environ.get("TRAINMEDIC_SLURM_KEEP"):
        subprocess.run(["bash", str(STOP_2411)], capture_output=True, timeout=120, check=False)


SLURM_VERSIONS = ("22.05", "24.11")


@pytest.fixture(params=SLURM_VERSIONS)
def slurm_any(request: pytest.FixtureRequest) -> Cluster:
    """Each real Slurm this project runs, in turn: a test that takes it runs once per version."""
    name = "slurm_cluster" if request.param == "22.05" else "slurm2411_cluster"
    cluster = request.getfixturevalue(name)
    assert isinstance(cluster, Cluster)
    return cluster


def read_topic(bootstrap: str, topic: str, seconds: float = 3.0) -> list[bytes]:
    """Every record of a topic, read by partition assignment (no group join to wait for)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from bus.config import consumer_config
    from schemas.topics import DEFAULT_PARTITIONS

    consumer = Consumer(consumer_config(bootstrap, "reader", "reader"))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(DEFAULT_PARTITIONS)])
    out: list[bytes] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        msg = consumer.poll(0.1)
        if msg is not None and not msg.error():
            out.append(msg.value() or b"")
    consumer.close()
    return out


def wait_placed(bootstrap: str, jobs: Iterable[str], timeout: float = 60.0) -> None:
    """Wait until the streams worker has written each job's placement: its key in the placements
    table's changelog (`<app id>-placements-changelog`), which the worker writes after putting the
    job into its placement index. What a test publishes for those jobs' nodes after this is routed
    to the jobs, as it would be after the Slurm producer's snapshot."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from bus.config import admin_config, consumer_config

    want = {str(j) for j in jobs}
    admin = AdminClient(admin_config(bootstrap))

    def changelog() -> str | None:
        names = [t for t in admin.list_topics(timeout=10).topics if t.endswith("-placements-changelog")]
        return names[0] if len(names) == 1 else None

    topic = wait_for("the placements changelog", changelog, timeout)
    consumer = Consumer(consumer_config(bootstrap, "test-placed", "test-placed"))
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    seen: set[str] = set()

    def placed() -> bool:
        for msg in consumer.consume(num_messages=1000, timeout=0.2):
            key = msg.key()
            if not msg.error() and key and msg.value() is not None:
                seen.add(str(orjson.loads(key)))
        return want <= seen

    try:
        wait_for(f"the placements of jobs {', '.join(sorted(want - seen))} written by the worker", placed, timeout)
    finally:
        consumer.close()


def slurm_cmd(cluster: Cluster, *argv: str) -> str:
    """Run a Slurm client command on the local cluster; fail the test with its stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=cluster.env(), timeout=30, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@pytest.fixture
def slurm(slurm_cluster: Cluster) -> Iterator[Any]:
    """The Slurm CLI backend on a clean cluster: no jobs, every node undrained and idle, before and after."""
    from sinks.backends.slurm_cli import SlurmCliBackend

    backend = SlurmCliBackend(slurm_conf=slurm_cluster.slurm_conf)
    nodes = ("gpu01", "gpu02", "gpu03", "gpu04")

    def reset() -> None:
        slurm_cmd(slurm_cluster, "scancel", "--user", "root")
        for node in nodes:
            if backend.node_state(node).drained:
                backend.resume_node(node)
        wait_for(
            "all nodes idle",
            lambda: all((s := backend.node_state(n)).state == "IDLE" and not s.flags for n in nodes),
            timeout=60,
        )

    reset()
    yield backend
    reset()


@pytest.fixture(autouse=True)
def _config_env_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """`trainmedic --config F` sets TRAINMEDIC_CONFIG for the processes it starts; run in-process by
    CliRunner it would leak into every later test of the worker (a later test then read that
    config's token). Recording the variable here makes monkeypatch put it back after each test."""
    from trainmedic.settings import CONFIG_ENV

    previous = os.environ.get(CONFIG_ENV)
    monkeypatch.setenv(CONFIG_ENV, previous or "unset")
    if previous is None:
        monkeypatch.delenv(CONFIG_ENV)
