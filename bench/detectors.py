"""Detector throughput benchmark (not a test): prints figures and writes bench/results/detectors.json and the
result in the common format, bench/results/detectors/<date>-<commit>.json (bench/results.py).

- Progress parser (producers.progress): lines/s on real progress lines (every line of
  tests/fixtures/progress/*.log but non_progress.log) and on real lines that are no progress
  report (the rest of tests/fixtures/logs and non_progress.log), with and without two custom
  patterns. Target: >= 100k lines/s on non-matching lines.
- HangDetector: progress samples/s and GPU samples/s through observe_*, and check() over many
  running jobs.
- StragglerDetector: GPU and progress samples/s through observe_*, and check() of one large job
  with a full window.

Everything is in memory and single-threaded; records are built before the clock starts.

Run: .venv/bin/python -m bench.detectors [--lines 300000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import figures, results
from bench.machine import machine
from producers.joblogs import split_rank_prefix
from producers.progress import ProgressParser
from schemas.events import GpuMetrics, GpuSample, ProgressBatch, ProgressSample, SchedEvent
from streams.detectors.hang import HangDetector
from streams.detectors.straggler import StragglerDetector

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PROGRESS = REPO / "tests" / "fixtures" / "progress"
LOGS = REPO / "tests" / "fixtures" / "logs"
TARGETS = {"parser_non_matching_lines_per_s": 100_000.0}
T0 = 1_700_000_000.0


def rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def corpus() -> tuple[list[tuple[str, int | None]], list[tuple[str, int | None]]]:
    parser = ProgressParser()
    matching: list[tuple[str, int | None]] = []
    other: list[tuple[str, int | None]] = []
    files = sorted(PROGRESS.glob("*.log")) + sorted(LOGS.glob("*.log"))
    for path in files:
        for raw in path.read_text().splitlines():
            r = split_rank_prefix(raw)
            hit = parser.parse(r.text, 0.0, r.rank)
            (matching if hit is not None else other).append((r.text, r.rank))
    return matching, other


def bench_parser(n_lines: int) -> dict[str, Any]:
    matching, other = corpus()
    custom = ProgressParser(
        [
            r"iter: (?P<step>\d+)/\d+, loss: (?P<loss>[\d.]+),.*batch_cost: (?P<step_time_s>[\d.]+)",
            r"loss=(?P<loss>[\d.]+),.*wps=(?P<tokens_per_s>[\d.]+),.*num_updates=(?P<step>\d+)",
        ]
    )
    out: dict[str, Any] = {"distinct_matching_lines": len(matching), "distinct_non_matching_lines": len(other)}
    for label, parser in (("builtin", ProgressParser()), ("with_2_custom_patterns", custom)):
        for kind, lines in (("matching", matching), ("non_matching", other)):
            work = (lines * (n_lines // len(lines) + 1))[:n_lines]
            parse = parser.parse

            def run(work: list[tuple[str, int | None]] = work, parse: Any = parse) -> None:
                for text, rank in work:
                    parse(text, 1.0, rank, "gpu01")

            out[f"{label}_{kind}_lines_per_s"] = round(rate(len(work), run))
    return out


def progress_batches(jobs: int, batches: int, ranks: int, every: float) -> list[ProgressBatch]:
    out = []
    for b in range(batches):
        t = T0 + 60 + b * every
        for j in range(jobs):
            samples = [
                ProgressSample(ts=t, rank=r, node=f"n{j}-{r // 8}", step=b + 1, step_time_s=every, format="torchtitan")
                for r in range(ranks)
            ]
            out.append(ProgressBatch(event_id=f"p{j}-{b}", event_time=t, job_id=str(j), job_nodes=[], samples=samples))
    return out


def gpu_samples(nodes: list[str], samples: int, every: float, gpus: int = 8) -> list[GpuSample]:
    out = []
    for k in range(samples):
        t = T0 + k * every
        for n in nodes:
            out.append(
                GpuSample(
                    event_id=f"g{n}-{k}",
                    event_time=t,
                    node=n,
                    gpus=[
                        GpuMetrics(
                            index=i,
                            utilization_pct=97.0,
                            sm_clock_mhz=1980.0 - (300.0 if (n.endswith("-3") and i == 5) else 0.0),
                            power_w=650.0,
                            throttle_reasons=["hw_thermal"] if (n.endswith("-3") and i == 5) else [],
                        )
                        for i in range(gpus)
                    ],
                )
            )
    return out


def sched_running(jobs: int, nodes_per_job: int) -> list[SchedEvent]:
    return [
        SchedEvent(
            event_id=f"s{j}",
            event_time=T0,
            kind="job",
            job_id=str(j),
            state="RUNNING",
            nodes=[f"n{j}-{k}" for k in range(nodes_per_job)],
        )
        for j in range(jobs)
    ]


def bench_hang() -> dict[str, Any]:
    jobs, nodes_per_job, ranks = 200, 4, 32
    det = HangDetector()
    for ev in sched_running(jobs, nodes_per_job):
        det.observe_sched(ev, T0)
    batches = progress_batches(jobs, 20, ranks, every=2.0)
    n_samples = sum(len(b.samples) for b in batches)

    def feed() -> None:
        for b in batches:
            det.observe_progress(b, b.event_time)

    progress_rate = rate(n_samples, feed)
    nodes = [f"n{j}-{k}" for j in range(jobs) for k in range(nodes_per_job)]
    gpus = gpu_samples(nodes, 10, every=5.0)

    def feed_gpu() -> None:
        for g in gpus:
            det.observe_gpu(g, g.event_time)

    gpu_rate = rate(len(gpus), feed_gpu)
    checks = 200
    now = T0 + 60 + 20 * 2.0

    def check() -> None:
        for i in range(checks):
            det.check(now + i * 0.1)

    check_rate = rate(checks, check)
    return {
        "jobs": jobs,
        "ranks_per_job": ranks,
        "progress_samples_per_s": round(progress_rate),
        "gpu_samples_per_s": round(gpu_rate),
        "gpu_sample_gpus": 8,
        "check_calls_per_s": round(check_rate, 1),
        "jobs_checked_per_s": round(check_rate * jobs),
    }


def _check_ms(det: StragglerDetector, now: float, checks: int) -> float:
    """Milliseconds per check() of a fed detector (built with check_every_s=0: every call judges)."""
    return round(1000.0 / rate(checks, lambda: [det.check(now + i) for i in range(checks)]), 2)


def _gpu_only_check_ms(nodes: int) -> float:
    """One check of a `nodes`-node job with a full window of 5 s GPU readings (no progress)."""
    det = StragglerDetector(check_every_s=0)
    for ev in sched_running(1, nodes):
        det.observe_sched(ev, T0)
    for g in gpu_samples([f"n0-{k}" for k in range(nodes)], 60, every=5.0):
        det.observe_gpu(g, g.event_time)
    return _check_ms(det, T0 + 300.0, 5)


def bench_straggler() -> dict[str, Any]:
    nodes_per_job, ranks = 16, 128
    # check_every_s=0: every check() call judges the job. With the default interval (15 s) the
    # timed calls below mostly returned at once and the figure understated a check.
    det = StragglerDetector(check_every_s=0)
    for ev in sched_running(1, nodes_per_job):
        det.observe_sched(ev, T0)
    gpus = gpu_samples([f"n0-{k}" for k in range(nodes_per_job)], 60, every=5.0)
    batches = progress_batches(1, 150, ranks, every=2.0)
    n_samples = sum(len(b.samples) for b in batches)

    def feed_gpu() -> None:
        for g in gpus:
            det.observe_gpu(g, g.event_time)

    def feed_progress() -> None:
        for b in batches:
            det.observe_progress(b, b.event_time)

    gpu_rate = rate(len(gpus), feed_gpu)
    progress_rate = rate(n_samples, feed_progress)
    now = T0 + 300.0
    found = det.check(now)
    return {
        "nodes": nodes_per_job,
        "gpus_per_node": 8,
        "ranks": ranks,
        "gpu_samples_per_s": round(gpu_rate),
        "progress_samples_per_s": round(progress_rate),
        "check_ms_full_window": _check_ms(det, now, 20),
        "check_ms_full_window_256_nodes": _gpu_only_check_ms(256),
        "anomalies": [a.line for a in found],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=300_000, help="lines per parser measurement")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = results.now()
    print(f"progress parser, {args.lines} lines per measurement ...", flush=True)
    parser_result = bench_parser(args.lines)
    print(f"  {parser_result}", flush=True)
    print("hang detector ...", flush=True)
    hang = bench_hang()
    print(f"  {hang}", flush=True)
    print("straggler detector ...", flush=True)
    straggler = bench_straggler()
    print(f"  {straggler}", flush=True)
    result: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "targets": TARGETS,
        "parser": parser_result,
        "hang": hang,
        "straggler": straggler,
    }
    met = parser_result["builtin_non_matching_lines_per_s"] >= TARGETS["parser_non_matching_lines_per_s"]
    print(
        f"parser non-matching target {TARGETS['parser_non_matching_lines_per_s']:.0f} lines/s: {'met' if met else 'MISSED'}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "detectors.json").write_text(json.dumps(result, indent=2) + "\n")
    common = results.record(
        "detectors",
        figures.detectors(result),
        root=args.out,
        started=started,
        machine=result["machine"],
        details={**result, "lines_per_measurement": args.lines},
    )
    print(f"wrote {args.out / 'detectors.json'} and {common}")


if __name__ == "__main__":
    main()
