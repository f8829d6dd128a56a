"""Single scale points without the full search (bench.pipeline runs that until a size fails).

Run: .venv/bin/python -m bench.scale_points [--seconds 150] [--profile-seconds 30] 1024x1 1024x2 4096x1@5
(NODESxWORKERS, 90 s each; @S: edge aggregation, each node's GPU samples published every S s and at once
on a health change; --profile-seconds: py-spy the streams worker for that long, from 30 s before the end).
Prints one JSON row per point and writes them to var/bench/scale-points/rows.json (after each point), then
the result of the whole invocation to bench/results/scale_points/ (--out: another results folder).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import figures, results
from bench.machine import machine
from bench.pipeline import REPO, BaselineAssumptions, _scale_row, evaluate, run_child, scale_config, sustained

_SPEC = re.compile(r"(?P<nodes>[0-9]+)x(?P<workers>[0-9]+)(?:@(?P<every>[0-9]+(?:\.[0-9]+)?))?")


@dataclass(frozen=True)
class Point:
    nodes: int
    workers: int
    every_s: float | None  # edge summary period; None: every reading published

    @property
    def name(self) -> str:
        return f"scale-{self.nodes}-w{self.workers}" + (f"-every{self.every_s:g}" if self.every_s else "")


def point(spec: str) -> Point:
    """NODESxWORKERS[@S], e.g. 4096x1@5; an argparse type, so a bad one is named in the usage error."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NODESxWORKERS or NODESxWORKERS@SECONDS, e.g. 4096x1@5")
    p = Point(int(m["nodes"]), int(m["workers"]), float(m["every"]) if m["every"] else None)
    if p.nodes < 2 or p.workers < 1 or (p.every_s is not None and p.every_s <= 0):
        raise argparse.ArgumentTypeError(f"{spec!r}: needs at least 2 nodes, 1 worker and a summary period > 0")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale_points", description="Single scale points of bench.pipeline."
    )
    p.add_argument("--seconds", type=float, default=90.0, help="how long each point runs (default 90)")
    p.add_argument("--profile-seconds", type=float, default=0.0, help="py-spy the streams worker this long (0: off)")
    p.add_argument("--out", type=Path, default=results.RESULTS, help="results folder (default bench/results)")
    p.add_argument(
        "points", nargs="+", type=point, metavar="NODESxWORKERS[@S]", help="e.g. 4096x1@5: @S, edge summaries every S s"
    )
    a = p.parse_args(argv)
    if not a.seconds > 0:  # NaN too
        p.error("--seconds must be > 0")
    if not a.profile_seconds >= 0:
        p.error("--profile-seconds must be >= 0")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    out = REPO / "var" / "bench" / "scale-points"
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    ref: float | None = None
    seconds: float = a.seconds
    profile_s: float = a.profile_seconds
    started = results.now()
    for pt in a.points:
        cfg = scale_config(pt.nodes, seconds, str(out / "data"), 7)
        cfg.workers = pt.workers
        cfg.gpu_summary_every_s = pt.every_s
        cfg.name = pt.name
        if profile_s > 0:
            # The straggler window (90 s) is full by then: the profile sees the steady state.
            cfg.profile_s = profile_s
            cfg.profile_at_s = max(0.0, seconds - 30.0)
        t = time.time()
        ev = evaluate(run_child(cfg, out, timeout_s=900), BaselineAssumptions())
        ok, why = sustained(ev, ref)
        if ref is None:
            ref = ev["overall"]["detection_s"]["p95"]
        r = _scale_row(ev)
        row = {
            "nodes": pt.nodes,
            "workers": pt.workers,
            "gpu_summary_every_s": cfg.gpu_summary_every_s,
            "sustained": ok,
            "why": why,
            "detection_s": r["detection_s"],
            "gpus_per_central_core": r["gpus_per_central_core"],
            "cpu_pct": r["resources"]["cpu_pct"],
            "central_cpu_pct": r["resources"].get("central_cpu_pct"),
            "lag_max_s": r["lag_max_s"],
            # The probes' lag second by second (after the 10 s warm-up), per agent: a start-up burst
            # and a steady state read differently.
            "lag_series": r["lag_series"],
            "input_events_per_s": r["input_events_per_s"],
            "wall_s": round(time.time() - t),
        }
        if profile_s > 0:
            row["profile"] = ev.get("profile")
        rows.append(row)
        print(json.dumps(row), flush=True)
        # After each point: a later point that fails or is stopped keeps the earlier ones.
        (out / "rows.json").write_text(json.dumps(rows, indent=1))
    parameters = {
        "command": " ".join(["python -m bench.scale_points", *argv]),
        "seconds": seconds,
        "profile_seconds": profile_s,
        "points": [f"{p.nodes}x{p.workers}" + (f"@{p.every_s:g}" if p.every_s else "") for p in a.points],
    }
    details = {**parameters, "rows": rows}
    path = results.record(
        "scale_points", figures.scale_points(details), root=a.out, started=started, machine=machine(), details=details
    )
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
