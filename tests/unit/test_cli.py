"""The CLI's shape: commands by noun, help without Python types, errors mapped to exit statuses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from schemas.errors import ExitCode, NotFound, TrainmedicError, Unavailable, UsageError
from trainmedic.cli.base import new_app
from trainmedic.cli.main import app

runner = CliRunner()


def _paths(cmd: Any, path: list[str]) -> list[list[str]]:
    found = [path]
    if isinstance(cmd, typer.core.TyperGroup):
        ctx = typer.Context(cmd)
        for name in cmd.list_commands(ctx):
            found += _paths(cmd.get_command(ctx, name), [*path, name])
    return found


COMMANDS = _paths(typer.main.get_command(app), [])


def test_the_command_tree_is_by_noun() -> None:
    names = {" ".join(p) for p in COMMANDS}
    assert {
        "recommendations list",
        "recommendations approve",
        "recommendations reject",
        "recommendations label",
        "policy check",
        "policy explain",
        "policy replay",
        "nodes list",
        "nodes resume",
        "mode show",
        "mode set",
        "audit db migrate",
        "audit db status",
        "readiness",
    } <= names
    # One way to do each thing: the old top-level spellings are gone.
    assert not {"approve", "reject", "label", "replay", "resume", "db"} & names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "trainmedic")
def test_help_shows_no_python_types(path: list[str]) -> None:
    result = runner.invoke(app, [*path, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert not re.findall(r"<[\w\[\]|, ]+>", result.output), result.output


@pytest.mark.parametrize(
    ("args", "status", "needle"),
    [
        (["mode", "set", "sometimes"], ExitCode.USAGE, "mode 'sometimes': expected one of"),
        (["recommendations", "reject", "dec-x", "--reason", "nope"], ExitCode.USAGE, "--reason 'nope'"),
        (["policy", "check", "/nonexistent.yaml"], ExitCode.USAGE, "cannot read"),
        (["recommendations", "approve", "dec-x"], ExitCode.UNAVAILABLE, "trainmedic up is not running"),
        (["nodes", "list", "--api", "http://127.0.0.1:9"], ExitCode.USAGE, "no token: set TRAINMEDIC_TOKEN"),
    ],
)
def test_errors_exit_with_their_status_and_one_line(
    tmp_path: Path, args: list[str], status: ExitCode, needle: str
) -> None:
    result = runner.invoke(app, [*args, "--data-dir", str(tmp_path)] if args[0] != "policy" else args)
    assert result.exit_code == status, result.output
    assert needle in result.stderr and "Traceback" not in result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")


def test_the_token_comes_from_the_settings_never_a_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.invoke(app, ["nodes", "list", "--token", "t"]).exit_code == ExitCode.USAGE
    (tmp_path / "tok").write_text("t0ken\n")
    monkeypatch.setenv("TRAINMEDIC_TOKEN_FILE", str(tmp_path / "tok"))
    result = runner.invoke(app, ["nodes", "list", "--api", "http://127.0.0.1:9", "--data-dir", str(tmp_path)])
    assert result.exit_code == ExitCode.UNAVAILABLE and "cannot reach" in result.stderr  # got past the token


@pytest.mark.parametrize(("error", "status"), [(UsageError, 2), (NotFound, 1), (Unavailable, 3), (TrainmedicError, 2)])
def test_every_app_maps_the_error_classes(error: type[TrainmedicError], status: int) -> None:
    sub = new_app()

    @sub.command()
    def fails() -> None:
        raise error("it went wrong")

    @sub.command()
    def other() -> None:
        pass

    result = runner.invoke(sub, ["fails"])
    assert result.exit_code == status and result.stderr == "error: it went wrong\n"


def test_every_exception_class_derives_from_the_root() -> None:
    import importlib
    import inspect
    import pkgutil

    outside = []
    for pkg in ("schemas", "bus", "producers", "streams", "sinks", "slurmio", "trainmedic", "sim", "bench"):
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
            mod = importlib.import_module(info.name)
            outside += [
                f"{mod.__name__}.{name}"
                for name, obj in vars(mod).items()
                if inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == mod.__name__
                and not issubclass(obj, TrainmedicError)
            ]
    assert outside == []
