"""The suite's time per test file and per fixture, as markdown tables for docs/testing.md.

Two inputs: the files `TMTEST_TIMINGS=DIR pytest ...` writes (tests/budget.py: every test
phase and fixture setup, per xdist worker), or the output of `pytest --durations=0` (phases only,
no fixtures: what a run without the timing hook gives).

Run: .venv/bin/python -m tests.timings --timings-dir DIR | --durations-log FILE [--top N]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

_DURATION = re.compile(r"^(?P<s>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<test>\S+)")

Phase = tuple[str, str, float]  # (test nodeid, phase, seconds)
Fixture = tuple[str, str, str, float]  # (fixture, scope, test nodeid, seconds)


def from_durations_log(path: Path) -> list[Phase]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if m := _DURATION.match(line.strip()):
            out.append((m["test"], m["phase"], float(m["s"])))
    return out


def from_timings_dir(folder: Path) -> tuple[list[Phase], list[Fixture]]:
    phases: list[Phase] = []
    fixtures: list[Fixture] = []
    for path in sorted(folder.glob("timings-*.json")):
        data = json.loads(path.read_text())
        phases += [(t, p, s) for t, p, s, _ in data["phases"]]
        fixtures += [tuple(f) for f in data["fixtures"]]  # type: ignore[misc]
    return phases, fixtures


def per_file_table(phases: list[Phase], top: int) -> list[str]:
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    tests: dict[str, set[str]] = defaultdict(set)
    for test, phase, seconds in phases:
        file = test.split("::", 1)[0]
        rows[file][phase] += seconds
        tests[file].add(test)
    total = sum(sum(r.values()) for r in rows.values())
    ranked = sorted(rows.items(), key=lambda kv: -sum(kv[1].values()))
    lines = [
        f"All {len(rows)} files, {sum(len(t) for t in tests.values())} tests: {total:.0f} s of test time "
        f"(setup + call + teardown, summed over workers).",
        "",
        "| file | tests | total s | setup s | call s | teardown s |",
        "|---|---|---|---|---|---|",
    ]
    for file, r in ranked[:top]:
        lines.append(
            f"| `{file}` | {len(tests[file])} | {sum(r.values()):.1f} | {r['setup']:.1f} | {r['call']:.1f} "
            f"| {r['teardown']:.1f} |"
        )
    return lines


def per_fixture_table(fixtures: list[Fixture], top: int) -> list[str]:
    rows: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, scope, _test, seconds in fixtures:
        rows[(name, scope)].append(seconds)
    ranked = sorted(rows.items(), key=lambda kv: -sum(kv[1]))
    lines = ["| fixture | scope | setups | total s | mean s |", "|---|---|---|---|---|"]
    for (name, scope), times in ranked[:top]:
        lines.append(f"| `{name}` | {scope} | {len(times)} | {sum(times):.1f} | {sum(times) / len(times):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Per-file and per-fixture test times as markdown.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--timings-dir", type=Path, help="the folder TMTEST_TIMINGS pointed at")
    source.add_argument("--durations-log", type=Path, help="output of pytest --durations=0")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    args = parser.parse_args(argv)
    if args.timings_dir:
        phases, fixtures = from_timings_dir(args.timings_dir)
    else:
        phases, fixtures = from_durations_log(args.durations_log), []
    if not phases:
        print("error: no test timings found", file=sys.stderr)
        return 2
    print("\n".join(per_file_table(phases, args.top)))
    if fixtures:
        print()
        print("\n".join(per_fixture_table(fixtures, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
