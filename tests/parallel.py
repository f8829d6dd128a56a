"""The suite in parallel (pytest-xdist) without two tests on one Slurm cluster at a time.

Each xdist worker is a session of its own: its broker, chDB folder and temporary folders are
its own. The two local Slurm clusters are not: each is one machine-wide set of daemons on fixed
ports with four nodes, and its tests drain, requeue and `scancel --user root` there, so two of
them at once would break each other's jobs. Three things keep them apart:

- **Grouping**: every test that uses a cluster gets the `xdist_group` of that cluster, so
  `--dist loadgroup` runs one cluster's tests on one worker, one after another, while the other
  workers take everything else.
- **A lock per cluster**, held from a test's setup to its teardown by every test that uses the
  cluster (both locks, in one order, for a test that uses both). Grouping alone would let a test
  that uses both clusters, or a run with another `--dist` mode, overlap a test of the other group.
- **Started once**: the start scripts run under a file lock. Under xdist the worker that started
  a cluster leaves it up (another worker may still need it) and writes down how to stop it; the
  controller stops it when the run ends. `make test` starts both clusters before pytest, so there
  the scripts only answer "already up".

Which cluster a test uses is read from its fixtures (`slurm`, `slurm_cluster`,
`slurm2411_cluster`) and its parameters (`slurm_any`'s "22.05"/"24.11", or a fixture parameter
naming a cluster fixture); a test marked `slurm` that asks for its cluster at run time without
saying which is taken to use the 22.05 one, the cluster such tests ask for.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import pytest

RUN_ENV = "TMTEST_RUN"
LOCK_DIR = Path(os.environ.get("TMTEST_LOCKS", "/tmp/trainmedic-test-locks"))
CLUSTER_OF_FIXTURE = {"slurm": "22.05", "slurm_cluster": "22.05", "slurm2411_cluster": "24.11"}
CLUSTER_OF_PARAM = {"22.05": "22.05", "slurm_cluster": "22.05", "24.11": "24.11", "slurm2411_cluster": "24.11"}
CLUSTERS_KEY = pytest.StashKey[frozenset[str]]()


def in_xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clusters_of(item: pytest.Item) -> frozenset[str]:
    """The Slurm clusters ("22.05", "24.11") a collected test uses."""
    names = set(getattr(item, "fixturenames", ()))
    used = {CLUSTER_OF_FIXTURE[n] for n in names if n in CLUSTER_OF_FIXTURE}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        used |= {CLUSTER_OF_PARAM[v] for v in callspec.params.values() if isinstance(v, str) and v in CLUSTER_OF_PARAM}
    if not used and item.get_closest_marker("slurm") is not None:
        used.add("22.05")
    return frozenset(used)


def cluster_script_lock(state_dir: Path) -> AbstractContextManager[None]:
    """The lock a cluster's scripts run under on this machine: its start script, and the scripts
    that run it again (slurmrestd.sh restarts slurmctld through start-2411.sh)."""
    return _flock(LOCK_DIR / f"{state_dir.name}.start.lock")


def start_cluster_once(
    state_dir: Path, start: Sequence[str], stop: Sequence[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a cluster's (idempotent) start script, one caller at a time on this machine.

    Under xdist a cluster this call started is recorded for the controller to stop at the end.
    """
    with cluster_script_lock(state_dir):
        proc = subprocess.run(list(start), capture_output=True, text=True, timeout=timeout, check=False)
        run = os.environ.get(RUN_ENV)
        if proc.returncode == 0 and "already up" not in proc.stdout and in_xdist_worker() and run:
            (LOCK_DIR / f"started-{run}-{state_dir.name}.json").write_text(json.dumps(list(stop)))
    return proc


def stop_here(start_stdout: str) -> bool:
    """Whether the session fixture that ran the start script stops the cluster at its end:
    only outside xdist, and only when the script started something."""
    return "already up" not in start_stdout and not in_xdist_worker()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-slurm",
        action="store_true",
        help="leave out every test that uses a local Slurm cluster (while another run holds the clusters)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        os.environ.setdefault(RUN_ENV, uuid.uuid4().hex[:12])


# First: pytest-xdist's worker turns each item's `xdist_group` mark into its node id in its own
# modifyitems hook, so the marks must be there before it runs (tests/unit/test_parallel_grouping.py).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    left_out: list[pytest.Item] = []
    for item in items:
        clusters = clusters_of(item)
        item.stash[CLUSTERS_KEY] = clusters
        if clusters and config.getoption("--without-slurm"):
            left_out.append(item)
        elif clusters and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"slurm-{min(clusters)}"))
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected ids to the scheduler
def pytest_collection_finish(session: pytest.Session) -> None:
    _group_node_ids(session.config, session.items)


def _group_node_ids(config: pytest.Config, items: list[pytest.Item]) -> None:
    """What pytest-xdist's worker does for `--dist loadgroup` (xdist/remote.py, 3.8): a test's
    `xdist_group` names go at the end of its node id ("ID@GROUP"), which is what the scheduler
    groups by. xdist writes `item._nodeid`; pytest 9 reads a node's id from `item._id` instead, so
    there xdist's renaming is lost and every group is split over the workers. Done here where it
    did not take (pytest 8: xdist's own renaming stands and this does nothing)."""
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    from _pytest.nodeid import NodeId  # pytest 9's structured node id (private: pinned by the test below)

    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        if not names or item.nodeid.rfind("@") > item.nodeid.rfind("]"):
            continue
        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _slurm_cluster_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    clusters = request.node.stash.get(CLUSTERS_KEY, frozenset())
    with ExitStack() as held:
        for cluster in sorted(clusters):
            held.enter_context(_flock(LOCK_DIR / f"slurm-{cluster}.lock"))
        yield


def pytest_unconfigure(config: pytest.Config) -> None:
    run = os.environ.get(RUN_ENV)
    if hasattr(config, "workerinput") or not run or os.environ.get("TRAINMEDIC_SLURM_KEEP"):
        return
    for record in sorted(LOCK_DIR.glob(f"started-{run}-*.json")):
        subprocess.run(json.loads(record.read_text()), capture_output=True, timeout=120, check=False)
        record.unlink(missing_ok=True)
