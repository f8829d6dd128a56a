"""The repeat-fault benchmark, small: `python -m bench.repeat_faults --scenarios no_progress --limit 1`.

The real stack (embedded broker, streams worker, executor, chDB audit) against the simulated Slurm:
a job whose rank dies at the same step in every attempt is requeued once, replays steps below its
best one, dies again and is stopped by the no-progress rule. The outcome is checked, not its timing.
The status-quo models are checked on their own (pure, no stack).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.repeat_faults import StatusQuo, status_quo_bad_node, status_quo_repeat
from tests.conftest import REPO


@pytest.mark.timeout(360)
@pytest.mark.slow(
    reason="two attempts of a job on the real stack, each ending in a dead rank that the hang detector sees "
    "after its silence window, a requeue between them and the stop: the smallest run of the no-progress rule"
)
def test_repeat_faults_smoke_stops_after_the_limit(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.repeat_faults",
            "--scenarios",
            "no_progress",
            "--limit",
            "1",
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
        timeout=340,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    ev = doc["scenarios"]["no_progress"]
    assert all(ev["checks"].values()), ev["checks"]
    tm = ev["trainmedic"]
    victim = tm["jobs"][tm["victim"]]
    # Attempt 1 progressed, was requeued once; attempt 2 replayed below its best step and was stopped.
    assert (victim["faults"], victim["restarts"], victim["stopped"]) == (2, 1, True), victim
    assert "no progress: 1 restarts in a row" in victim["stop_rule"]
    assert [f["action"] for f in tm["faults"]] == ["requeue", "stop"]
    assert [a["progressed"] for a in victim["attempts"][:2]] == [True, False]
    assert victim["attempts"][1]["start_step"] == victim["attempts"][1]["max_step"]  # replayed, no higher step
    # Only the victim was touched; the healthy job ran throughout.
    assert {f["job_id"] for f in tm["faults"]} == {tm["victim"]}
    assert tm["nodes_drained"] == []
    for world in ("auto", "person"):
        assert victim["gpu_h"] < ev["status_quo"][world]["gpu_h"]
    assert "GPU-hours lost" in md and "status quo" in md and "## Assumptions" in md
    assert "GPU-hours lost" in proc.stdout  # the table goes to stdout too


def test_status_quo_repeat_model() -> None:
    a = StatusQuo()
    # Slurm requeues on failure: each cycle is the 600 s watchdog + 1 s + the replay, until the notice at 1 h.
    auto = status_quo_repeat(a, "auto", replay_s=10.0, gpus=32)
    assert (auto["faults"], auto["restarts"], auto["stopped_s"]) == (6, 5, 3600.0)
    assert auto["gpu_h"] == 32.0 and auto["lost_s"] == 3600.0
    # A person restarts it 30 min after the watchdog: one restart before the notice.
    person = status_quo_repeat(a, "person", replay_s=10.0, gpus=32)
    assert (person["faults"], person["restarts"]) == (2, 1)
    # Slurm's cap on automatic requeues, where configured, holds the job earlier.
    capped = status_quo_repeat(StatusQuo(max_batch_requeue=2), "auto", replay_s=10.0, gpus=32)
    assert capped["restarts"] == 2 and capped["stopped_s"] < 3600.0 and "MaxBatchRequeue" in capped["why_stopped"]


def test_status_quo_bad_node_model_places_jobs_first_fit() -> None:
    nodes = [f"gpu{i:04d}" for i in range(1, 13)]
    a = StatusQuo()
    person = status_quo_bad_node(a, "person", nodes, [("A", 4), ("C", 2)], "gpu0001", 8.0, ("B", 4))
    # A fails, B gets its freed nodes (the bad one first) and fails; A's restart lands on it again;
    # the person drains it at 1 h. The healthy job is untouched.
    assert (person["jobs"]["A"]["faults"], person["jobs"]["B"]["faults"], person["jobs"]["C"]["faults"]) == (2, 1, 0)
    assert person["jobs"]["B"]["lost_s"] == pytest.approx(600 + 1800 + 1)
    assert person["node_drained_at_s"] == 3600.0
    auto = status_quo_bad_node(a, "auto", nodes, [("A", 4), ("C", 2)], "gpu0001", 8.0, ("B", 4))
    # Requeued at once, A lands on the bad node again every time until the drain.
    assert auto["jobs"]["A"]["faults"] == 6 and auto["jobs"]["B"]["faults"] == 0
