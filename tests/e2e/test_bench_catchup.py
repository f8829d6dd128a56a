"""The catch-up benchmark, small: `python -m bench.catchup --quick` (200 nodes, 20 s of events,
1 then 2 streams workers) against the embedded broker and the real streams worker.

The report must exist, and each run must have drained everything that was produced: every
agent's events-in counter at least the records produced on its topic, and the group's committed
offsets at the end of every partition. No wall-clock assertions: speeds are reported, not judged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(300)
def test_bench_catchup_quick_drains_the_backlog(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.catchup",
            "--quick",
            "--out",
            str(tmp_path),
            "--data-dir",
            str(tmp_path / "var"),
            "--prefix",
            "smoke",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc: dict[str, Any] = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    assert {"measured_at", "machine", "config", "preload", "runs"} <= set(doc)

    pre = doc["preload"]
    assert pre["dropped"] == {} and pre["offsets_consistent"]
    produced: dict[str, int] = pre["produced"]
    assert 200 * 20 <= produced["gpu.samples"] <= 200 * 21  # one per node per second
    assert produced["sched.events"] == doc["preload"]["jobs"] > 0  # every job's RUNNING
    assert produced["job.progress"] > 0

    assert [r["workers"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        assert "error" not in run, run.get("error")
        assert run["drained"], run
        consumed: dict[str, int] = {}
        for key, n in run["events_in_by_agent"].items():
            topic = key.split(" / ", 1)[1]
            if topic in produced:
                # Every agent that reads a topic read all of it (at least once).
                assert n >= produced[topic], (key, n, produced[topic])
                consumed[topic] = n
        assert set(consumed) == set(produced), (consumed, produced)
        # Committed offsets at the end the producer was acknowledged, partition by partition.
        for topic, parts in pre["by_partition"].items():
            for p, n in parts.items():
                assert run["committed"][topic][p] >= n, (topic, p)
        workers = run["per_worker"]
        assert len(workers) == run["workers"]
        assert sum(w["records_total"] for w in workers) >= sum(produced.values())
        for w in workers:
            assert w["ready_s"] is not None and w["cpu_s"]["total"] > 0
        # Between them the workers ended with every partition of every input topic.
        for topic in produced:
            owned = sorted(p for w in workers for p in w["partitions"][topic])
            assert owned == list(range(doc["config"]["partitions"])), (topic, owned)
        assert run["broker"]["peak_rss_mb"] > 0
    assert "## Drain" in md and "## Per worker" in md
