"""The issue's reference fault, written as real files and read by the real producers:
NCCL watchdog timeouts on the ranks of gpu01, gpu03, gpu04 and an Xid 79 in gpu02's
kernel log. Line texts come from tests/fixtures/logs (sources in SOURCES.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.kernel import KernelLogProducer
from sinks.audit import AuditStore
from sinks.backends.base import SchedulerBackend
from streams.policy import DEFAULT_POLICY
from tests.conftest import FIXTURES, wait_for
from trainmedic.stack.runtime import Stack, StackConfig

NODES = ["gpu01", "gpu02", "gpu03", "gpu04"]
RANKS_PER_NODE = 2
LOGS = FIXTURES / "logs"


def watchdog_line(rank: int) -> str:
    # First line of nccl_watchdog_timeout.log, with this rank's prefix and number.
    first = (LOGS / "nccl_watchdog_timeout.log").read_text().splitlines()[0]
    return first.replace("[rank0]:", f"[rank{rank}]:").replace("[Rank 0]", f"[Rank {rank}]")


def xid79_line(node: str) -> str:
    line = next(x for x in (LOGS / "xid79_kern.log").read_text().splitlines() if "Xid" in x)
    return line.replace(" gpu01 kernel:", f" {node} kernel:")


def write_cascade(root: Path, job_nodes: list[str], culprit: str) -> dict[str, Path]:
    paths = {}
    for i, node in enumerate(job_nodes):
        path = root / "job" / f"{node}.out"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (
            [] if node == culprit else [watchdog_line(r) for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE)]
        )
        path.write_text("".join(x + "\n" for x in lines))
        paths[node] = path
    kern = root / "nodes" / culprit / "kern.log"
    kern.parent.mkdir(parents=True, exist_ok=True)
    kern.write_text(xid79_line(culprit) + "\n")
    return paths


def publish_cascade(bootstrap: str, root: Path, job_id: str, job_nodes: list[str], culprit: str) -> None:
    paths = write_cascade(root, job_nodes, culprit)
    pub = Publisher(bootstrap, "test-producer")
    JobLogProducer(
        pub,
        job_id,
        list(paths.values()),
        JobLayout(tuple(job_nodes), RANKS_PER_NODE),
        partition="gpu",
        node_of_path={p: n for n, p in paths.items()},
    ).poll_once()
    KernelLogProducer(pub, root / "nodes" / culprit / "kern.log", node=culprit, from_start=True).poll_once()
    assert pub.flush(10) == 0


def publish_log_file(bootstrap: str, job_id: str, path: Path, nodes: list[str]) -> None:
    pub = Publisher(bootstrap, "test-producer")
    JobLogProducer(pub, job_id, [path], JobLayout(tuple(nodes), 8), partition="gpu").poll_once()
    assert pub.flush(10) == 0


def policy_file(folder: Path, **sections: Any) -> Path:
    """The packaged default policy with `sections` replaced, written to folder/policy.yaml."""
    data = yaml.safe_load(DEFAULT_POLICY.read_text())
    data.update(sections)
    path = folder / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_stack(
    bootstrap: str,
    chdb_url: str,
    database: str,
    backend: SchedulerBackend,
    data_dir: Path,
    mode: str | None = None,
    policy: Path | None = None,
) -> Stack:
    """The stack the loop tests run: short attribution windows, a 60 s verification timeout."""
    return Stack(
        StackConfig(
            data_dir=data_dir,
            bootstrap=bootstrap,
            clickhouse=chdb_url,
            database=database,
            mode=mode,
            policy=policy,
            settle_s=1.0,
            collateral_wait_s=3.0,
            verify_timeout_s=60.0,
        ),
        backend,
    ).start()


@contextlib.contextmanager
def running_stack(
    bootstrap: str, chdb_url: str, database: str, backend: SchedulerBackend, mode: str, data_dir: Path
) -> Iterator[Stack]:
    stack = start_stack(bootstrap, chdb_url, database, backend, data_dir, mode=mode)
    try:
        yield stack
    finally:
        stack.stop()


def incidents_of(store: AuditStore, job_id: str) -> list[dict[str, object]]:
    return store.query("SELECT * FROM {db}.incidents FINAL WHERE job_id = {j:String}", {"j": job_id})


def wait_incident(store: AuditStore, job_id: str, timeout: float = 60) -> dict[str, object]:
    return wait_for(f"an incident for job {job_id} in the audit", lambda: incidents_of(store, job_id), timeout)[0]
