"""`--dist loadgroup` really sends a group to one worker: a module's `xdist_group` mark and the
Slurm groups `tests/parallel.py` adds from a test's cluster fixtures.

Run as a real pytest-xdist session in a subprocess over generated test files: each test writes the
worker it ran on, and every test of a group must have run on the same one. Under pytest 9 with
pytest-xdist 3.8 they did not (the group was added to a node id pytest no longer reads), and the
Slurm clusters' tests only kept apart through their locks, waiting on each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

CONFTEST = """
import os
import pytest
pytest_plugins = ["tests.parallel"]  # the grouping under test, as tests/conftest.py loads it

@pytest.fixture
def slurm_cluster():
    return "22.05"

@pytest.fixture
def slurm2411_cluster():
    return "24.11"

@pytest.fixture
def record(request):
    yield
    with open(os.environ["GROUPING_OUT"], "a") as fh:
        fh.write(f"{request.node.name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""

MODULE_GROUP = """
import pytest
pytestmark = pytest.mark.xdist_group("built_once")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i, record):
    pass
"""

CLUSTERS = """
import pytest

@pytest.mark.parametrize("i", range(6))
def test_on_2205(i, slurm_cluster, record):
    pass

@pytest.mark.parametrize("i", range(6))
def test_on_2411(i, slurm2411_cluster, record):
    pass

@pytest.mark.parametrize("i", range(12))
def test_anywhere(i, record):
    pass
"""


def test_each_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_module_group.py").write_text(MODULE_GROUP)
    (tmp_path / "test_clusters.py").write_text(CLUSTERS)
    out = tmp_path / "workers.txt"
    # The outer run's worker, run id and lock folder stay out: this session's cluster locks are its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "TMTEST_"))}
    env |= {"GROUPING_OUT": str(out), "PYTHONPATH": str(REPO), "TMTEST_LOCKS": str(tmp_path / "locks")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-p",
         "no:randomly", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in out.read_text().splitlines():
        name, worker = line.split()
        workers[name.split("[")[0]].add(worker)
    assert set(workers) == {"test_grouped", "test_on_2205", "test_on_2411", "test_anywhere"}
    for group in ("test_grouped", "test_on_2205", "test_on_2411"):
        assert len(workers[group]) == 1, f"{group} ran on {sorted(workers[group])}"
    # The rest is shared out, so the run is parallel at all.
    assert len(workers["test_anywhere"] | workers["test_grouped"] | workers["test_on_2205"]) == 2
