"""The pipeline benchmark, small: `python -m bench.pipeline --quick` against the real stack.

A 40-node simulated cluster writes real files that the real tailers read; one fault of each
kind that shows in a short run (every explicit one, and a hang) goes in. The report must have
its structure, and every injected fault must have been detected with the right category. No
wall-clock assertions: latencies are reported, not judged, here.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from schemas.codec import decode
from schemas.events import Event, GpuSample, KernelEvent, LogBatch, ProgressBatch, SchedEvent
from sim import faults as F
from sim.cluster import ClusterConfig, SimCluster
from sim.gpus import NodeGpus, sample_event, sample_payload
from streams.detectors.signatures import SignatureDetector
from tests.conftest import FIXTURES, REPO

TYPES: dict[str, type[Event]] = {
    "gpu.samples": GpuSample,
    "job.logs": LogBatch,
    "job.progress": ProgressBatch,
    "node.kernel": KernelEvent,
    "sched.events": SchedEvent,
}


class Recorder:
    def __init__(self) -> None:
        self.msgs: list[tuple[str, bytes]] = []

    def publish_raw(self, topic_name: str, payload: bytes, key: bytes | None = None) -> None:
        self.msgs.append((topic_name, payload))


def test_fault_texts_are_the_fixtures_verbatim() -> None:
    for rel, texts in F.FIXTURE_TEXTS.items():
        body = (FIXTURES / rel).read_text()
        for text in texts:
            assert text in body, f"{text[:60]!r} is not in tests/fixtures/{rel}"


def test_healthy_noise_matches_no_signature() -> None:
    detector = SignatureDetector()
    noise = [*F.NCCL_INIT_LINES, *F.USER_WARNING_LINES, F.OVERFLOW_LINE, F.ITERATION_LINE]
    noise += list(F.checkpoint_lines(400, "/lustre/ckpt/x"))
    noise.append(F.iteration_line(12, 500_000, 2400.0, 3e-4, 512, 4.5, 65536.0, 0.8))
    for line in noise:
        assert detector.match_line(line) is None, line


def test_fast_payloads_are_the_events_the_codec_builds() -> None:
    a, b = NodeGpus("gpu0001", random.Random(1)), NodeGpus("gpu0001", random.Random(1))
    a.throttled = b.throttled = True
    a.load = b.load = "busy"
    a.lost.add(3)
    b.lost.add(3)
    fast = decode(GpuSample, orjson.dumps(sample_payload(a, 100.0, 101.0)))
    assert fast == sample_event(b, 100.0, 101.0)
    # Every event the simulator publishes, in both payload modes, decodes with the real codec.
    for payload in ("fast", "model"):
        rec = Recorder()
        cluster = SimCluster(ClusterConfig(nodes=24, seed=3, payload=payload, first_step_extra_s=(1.0, 2.0)), rec)
        t0 = 1_800_000_000.0
        cluster.prepare(now=t0)
        cluster.plan(F.EXPLICIT_KINDS, start_s=5.0, spacing_s=0.5, healthy_min=0)
        t = t0
        while t < t0 + 30:
            t += cluster.cfg.tick_s
            cluster.step(t)
        topics = {topic for topic, _ in rec.msgs}
        assert {"gpu.samples", "job.logs", "job.progress", "node.kernel", "sched.events"} <= topics
        for topic, body in rec.msgs:
            decode(TYPES[topic], body)


@pytest.mark.parametrize("payload", ["fast", "model"])
def test_edge_aggregation_in_the_simulator_sends_summaries_and_faults_at_once(payload: str) -> None:
    """With gpu_summary_every_s the simulator publishes what the node producer's EdgeSummary would:
    a healthy busy fleet every 5 s (its GPUs flipping power_cap in between), a lost GPU at once."""
    rec = Recorder()
    cluster = SimCluster(
        ClusterConfig(nodes=24, seed=3, payload=payload, gpu_summary_every_s=5.0, backdate_s=300.0),  # type: ignore[arg-type]
        rec,
    )
    t0 = 1_800_000_000.0
    cluster.prepare(now=t0)
    cluster.plan(["xid79"], start_s=20.3, spacing_s=1.0, healthy_min=0)
    t = t0
    while t < t0 + 40:
        t += cluster.cfg.tick_s
        cluster.step(t)
    samples = [decode(GpuSample, body) for topic, body in rec.msgs if topic == "gpu.samples"]
    (inj,) = [i for i in cluster.injections if not i.skipped]
    before = [s for s in samples if s.event_time < t0 + 20]
    # 20 s of 24 nodes read every second: 480 readings, of which one in five goes out.
    assert 24 * 4 <= len(before) <= 24 * 5
    lost = [s for s in samples if s.node == inj.node and any(g.lost for g in s.gpus)]
    assert lost, "the lost GPU was published"
    assert inj.injected_at is not None
    assert lost[0].event_time - inj.injected_at <= cluster.cfg.gpu_interval_s  # at the next reading, not the summary
    assert cluster.summary()["gpu_readings_suppressed_at_edge"] > 0


@pytest.mark.timeout(420)
@pytest.mark.slow(
    reason="every fault kind and a hang injected into a 40-node simulated cluster on the real stack: the one "
    "end-to-end check of every detector together; a hang is only seen after ~30 s of silence"
)
def test_bench_quick_detects_every_fault(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.pipeline",
            "--quick",
            # The fewest nodes whose jobs (seed 7) take one fault of each kind and leave two healthy.
            "--nodes",
            "40",
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
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "smoke_latency_cdf.png").stat().st_size > 0
        assert (tmp_path / "smoke_lag.png").stat().st_size > 0

    assert {"measured_at", "machine", "main"} <= set(doc)
    main = doc["main"]
    for key in ("cluster", "outcomes", "by_kind", "overall", "throughput", "lag", "resources", "assumptions"):
        assert key in main, key
    assert main["cluster"]["transport"] == "files"  # the small mode goes through real files and tailers
    for key in ("detection_s", "action_s", "running_again_s", "category_accuracy", "culprit_accuracy", "baseline"):
        assert key in main["overall"], key
    for agent in ("detect_gpu", "detect_logs", "detect_kernel"):
        assert main["lag"]["agents"][agent]["n"] > 0, agent
    assert {"worker", "broker", "main"} <= set(main["resources"]["cpu_pct"])
    assert main["throughput"]["gpu_samples_per_s"] > 0 and main["throughput"]["log_lines_per_s"] > 0

    injected = {o["kind"] for o in main["outcomes"]}
    assert injected == {*F.EXPLICIT_KINDS, "hang"}, injected
    for o in main["outcomes"]:
        assert not o["skipped"], o
        assert o.get("detected"), f"{o['kind']} on job {o['job_id']} was not detected"
        assert o["category"] == o["expected_category"], (
            f"{o['kind']}: category {o['category']}, want {o['expected_category']}"
        )
        assert "baseline" in o and o["baseline"]["detect_s"] >= 0
    # Faults whose action needs the right node must name it; healthy jobs are left alone.
    for o in main["outcomes"]:
        if o["expected_action"] == "drain_and_requeue":
            assert o["culprit"] == o["expected_culprit"], o
    assert main["actions_on_healthy_jobs"] == []
    assert main["innocent_drains"] == []
    for kind in injected:
        assert f"`{kind}`" in md
    assert "status quo" in md


# The plumbing (atheris, both harnesses, the report) on a short run: the logs harness costs ~9 ms an
# input under atheris here, and the long runs are bench/fuzz.py's defaults.
FUZZ_RUNS = 1500


def test_fuzz_run_of_the_log_and_kernel_parsers_finds_nothing(tmp_path: Path) -> None:
    """A short atheris run (bench/fuzz.py): any exception a parser lets out is a finding and
    fails this test, with the crashing input saved for `--reproduce`."""
    report = tmp_path / "fuzz.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fuzz", "--runs", str(FUZZ_RUNS), "--report", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.with_suffix(".json").read_text())
    assert {name: t["result"] for name, t in doc["targets"].items()} == {"logs": "ok", "kernel": "ok"}
    # The fuzzer must have done real work; the exact count is libFuzzer's to report (CI once read
    # fewer than requested from a loaded machine's output, with no finding), so a floor, a third of it.
    figures = {
        name: {k: t[k] for k in ("runs", "runs_requested", "seconds", "exit_code")}
        for name, t in doc["targets"].items()
    }
    assert all(t["runs"] >= FUZZ_RUNS // 3 for t in doc["targets"].values()), figures
