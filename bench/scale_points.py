"""Single scale points without the full search (bench.pipeline runs that until a size fails).

Run: .venv/bin/python -m bench.scale_points [--seconds 150] [--profile-seconds 30] 1024x1 1024x2 4096x1@5
(NODESxWORKERS, 90 s each; @S: edge aggregation, each node's GPU samples published every S s and at once
on a health change; --profile-seconds: py-spy the streams worker for that long, from 30 s before the end).
Prints one JSON row per point and writes them to var/bench/scale-points/rows.json.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from bench.pipeline import REPO, BaselineAssumptions, _scale_row, evaluate, run_child, scale_config, sustained


def main(argv: list[str]) -> int:
    out = REPO / "var" / "bench" / "scale-points"
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    ref: float | None = None
    seconds = 90.0
    profile_s = 0.0
    while argv[:1] in (["--seconds"], ["--profile-seconds"]):
        if len(argv) < 2:
            raise SystemExit(f"{argv[0]} needs a number of seconds")
        if argv[0] == "--seconds":
            seconds = float(argv[1])
        else:
            profile_s = float(argv[1])
        argv = argv[2:]
    for spec in argv:
        size, _, every = spec.partition("@")
        n, w = (int(x) for x in size.split("x"))
        cfg = scale_config(n, seconds, str(out / "data"), 7)
        cfg.workers = w
        if spec.endswith("@"):
            raise SystemExit(f"{spec}: @ needs the summary period in seconds (e.g. {size}@5)")
        cfg.gpu_summary_every_s = float(every) if every else None
        cfg.name = f"scale-{n}-w{w}" + (f"-every{every}" if every else "")
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
            "nodes": n,
            "workers": w,
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
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
