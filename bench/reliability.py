"""The reliability run: every fault-injection test of tests/reliability/, on the real broker,
chDB and processes, with its figures collected into one table.

Each test asserts its own guarantees (nothing lost, nothing done twice, bad input refused
with a reason); when it passes it writes one row (tests/reliability/harness.report_row):
fault injected, events sent, events found afterwards, duplicates, scheduler actions expected
and taken. The broker stays away 30 s here (TRAINMEDIC_OUTAGE_S), as the issue asks; the
test suite uses 5 s. The alert storm is 10,000 anomalies over 64 jobs here
(TRAINMEDIC_STORM_ANOMALIES, TRAINMEDIC_STORM_JOBS); the test suite sends 1,000 over 16.

    python -m bench.reliability [--outage-s 30] [--out bench/results]

Writes reliability.json and reliability.md, and the result in the common format,
reliability/<date>-<commit>.json (bench/results.py); exits non-zero if any test failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import figures, results
from bench.machine import machine

REPO = Path(__file__).resolve().parents[1]
TESTS = "tests/reliability"
STORM_ANOMALIES, STORM_JOBS = 10_000, 64  # tests/reliability/test_storm.py at the size
COLUMNS = ("fault injected", "events sent", "events found", "where", "duplicates", "actions expected", "actions taken")


def run(outage_s: float, out: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        env = dict(
            os.environ,
            TRAINMEDIC_RELIABILITY_ROWS=str(rows_path),
            TRAINMEDIC_OUTAGE_S=f"{outage_s:g}",
            TRAINMEDIC_STORM_ANOMALIES=str(STORM_ANOMALIES),
            TRAINMEDIC_STORM_JOBS=str(STORM_JOBS),
            # The suite's 60 s per test (tests/budget.py) is for its small sizes, not these.
            TMTEST_SLOW_LIMIT_S="900",
        )
        started = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", TESTS, "-q", "-p", "no:cacheprovider", "--tb=short", "--show-capture=no"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    doc: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": machine(),
        "outage_s": outage_s,
        "seconds": round(time.time() - started, 1),
        "pytest": summary,
        "passed": proc.returncode == 0,
        "rows": rows,
    }
    if proc.returncode != 0:
        doc["failures"] = proc.stdout[-6000:]
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "reliability.md").write_text(render(doc))
    results.record(
        "reliability",
        figures.reliability(doc),
        root=out,
        started=dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
        machine=doc["machine"],
        details=doc,
        report=out / "reliability.md",
    )
    return doc


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = (
            r["fault"],
            r["sent"],
            r["landed"],
            r["where"],
            r["duplicates"],
            r["actions_expected"],
            r["actions_taken"],
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        "# Reliability run",
        "",
        f"{doc['when']} on {m['cores']} cores ({m['cpu']}), Python {m['python']}; "
        f"`python -m bench.reliability` ran `pytest {TESTS}` "
        f"in {doc['seconds']} s: **{doc['pytest']}**.",
        "",
        "Each row is written by a test after its assertions held. *Events found*: events of the "
        "injection found afterwards in *where*; *duplicates*: events found there more than once; "
        "*actions*: scheduler changes (drain, requeue, cancel) expected and made.",
        "",
        *table(doc["rows"]),
        "",
    ]
    notes = [f"- **{r['fault']}**: {r['note']}" for r in doc["rows"] if r.get("note")]
    if notes:
        lines += ["## Notes", "", *notes, ""]
    if not doc["passed"]:
        lines += ["## Failures", "", "```", doc.get("failures", ""), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage-s", type=float, default=30.0, help="how long the broker stays away (default 30)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="report folder")
    args = parser.parse_args(argv)
    doc = run(args.outage_s, args.out)
    print("\n".join(table(doc["rows"])))
    print(f"\n{doc['pytest']}; report: {args.out / 'reliability.md'}")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
