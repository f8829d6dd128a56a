"""Diagnosis accuracy benchmark (not a test): prints figures and writes bench/results/accuracy.{json,md}.

Runs `trainmedic.diagnose.diagnose_paths` over every case of the labeled corpus of real logs in
tests/fixtures/corpus/<case>/ (log files plus label.yaml: category, culprit, action, source, notes)
and compares the diagnosis with the label:

- category accuracy: diagnosed category == labeled category;
- culprit accuracy: diagnosed culprit node == labeled culprit (null == null counts as right);
- action accuracy: recommended action == labeled action;
- false actions on healthy: healthy cases whose recommended action is not `none`.

Targets: >= 95 % category, >= 95 % culprit, 0 false actions on healthy cases.
Exit status 1 when a target is missed.

Run: .venv/bin/python -m bench.accuracy [--corpus tests/fixtures/corpus] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from schemas.vocab import ACTIONS, CATEGORIES
from trainmedic.diagnose import diagnose_paths

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "corpus" / "dev"
RESULTS = REPO / "bench" / "results"
LABEL_FILE = "label.yaml"
TARGETS: dict[str, float] = {"category_accuracy": 0.95, "culprit_accuracy": 0.95, "false_actions_on_healthy": 0}


class CorpusError(ValueError):
    pass


@dataclass(frozen=True)
class Label:
    category: str
    culprit: str | None
    action: str
    source: list[str]
    notes: str


@dataclass(frozen=True)
class Outcome:
    case: str
    files: list[str]
    label: Label
    category: str
    culprit: str | None
    action: str
    confidence: float
    signatures: list[str]
    explanation: str

    @property
    def category_ok(self) -> bool:
        return self.category == self.label.category

    @property
    def culprit_ok(self) -> bool:
        return self.culprit == self.label.culprit

    @property
    def action_ok(self) -> bool:
        return self.action == self.label.action

    @property
    def ok(self) -> bool:
        return self.category_ok and self.culprit_ok and self.action_ok


def load_label(path: Path) -> Label:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CorpusError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise CorpusError(f"{path}: expected a mapping")
    missing = {"category", "culprit", "action", "source", "notes"} - set(raw)
    if missing:
        raise CorpusError(f"{path}: missing {', '.join(sorted(missing))}")
    category, culprit, action, source = raw["category"], raw["culprit"], raw["action"], raw["source"]
    if category not in CATEGORIES:
        raise CorpusError(f"{path}: category {category!r} is not one of {', '.join(CATEGORIES)}")
    if action not in ACTIONS:
        raise CorpusError(f"{path}: action {action!r} is not one of {', '.join(ACTIONS)}")
    if culprit is not None and not isinstance(culprit, str):
        raise CorpusError(f"{path}: culprit must be a node name or null")
    if not isinstance(source, list) or not source or not all(isinstance(s, str) for s in source):
        raise CorpusError(f"{path}: source must be a non-empty list of URLs")
    return Label(category=category, culprit=culprit, action=action, source=source, notes=str(raw["notes"]).strip())


def case_dirs(corpus: Path) -> list[Path]:
    return sorted(p for p in corpus.iterdir() if p.is_dir() and (p / LABEL_FILE).is_file())


def case_files(case: Path) -> list[Path]:
    return sorted(p for p in case.iterdir() if p.is_file() and p.name != LABEL_FILE)


def run_case(case: Path) -> Outcome:
    label = load_label(case / LABEL_FILE)
    files = case_files(case)
    if not files:
        raise CorpusError(f"{case}: no log files")
    report = diagnose_paths(files)
    return Outcome(
        case=case.name,
        files=[p.name for p in files],
        label=label,
        category=report["category"],
        culprit=report["culprit"],
        action=report["action"],
        confidence=report["confidence"],
        signatures=sorted({e["signature"] for e in report["evidence"]}),
        explanation=report["explanation"],
    )


def _ratio(n: int, d: int) -> float:
    return round(n / d, 4) if d else 0.0


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    n = len(outcomes)
    per_category: dict[str, dict[str, Any]] = {}
    for cat in CATEGORIES:
        rows = [o for o in outcomes if o.label.category == cat]
        if not rows:
            continue
        per_category[cat] = {
            "cases": len(rows),
            "category_correct": sum(o.category_ok for o in rows),
            "culprit_correct": sum(o.culprit_ok for o in rows),
            "action_correct": sum(o.action_ok for o in rows),
            "diagnosed_as": dict(Counter(o.category for o in rows).most_common()),
        }
    healthy = [o for o in outcomes if o.label.category == "healthy"]
    false_actions = [o for o in healthy if o.action != "none"]
    # Precision view: of the cases diagnosed as a fault, how many were one.
    flagged = [o for o in outcomes if o.category != "healthy"]
    summary: dict[str, Any] = {
        "cases": n,
        "category_accuracy": _ratio(sum(o.category_ok for o in outcomes), n),
        "culprit_accuracy": _ratio(sum(o.culprit_ok for o in outcomes), n),
        "action_accuracy": _ratio(sum(o.action_ok for o in outcomes), n),
        "exact_match": _ratio(sum(o.ok for o in outcomes), n),
        "faults_flagged_that_are_faults": _ratio(sum(o.label.category != "healthy" for o in flagged), len(flagged)),
        "healthy_cases": len(healthy),
        "false_actions_on_healthy": len(false_actions),
        "per_category": per_category,
    }
    summary["targets_met"] = (
        summary["category_accuracy"] >= TARGETS["category_accuracy"]
        and summary["culprit_accuracy"] >= TARGETS["culprit_accuracy"]
        and summary["false_actions_on_healthy"] <= TARGETS["false_actions_on_healthy"]
    )
    return summary


def misses(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    rows = []
    for o in outcomes:
        if o.ok:
            continue
        wrong = [
            f for f, ok in (("category", o.category_ok), ("culprit", o.culprit_ok), ("action", o.action_ok)) if not ok
        ]
        rows.append(
            {
                "case": o.case,
                "wrong": wrong,
                "expected": {"category": o.label.category, "culprit": o.label.culprit, "action": o.label.action},
                "got": {"category": o.category, "culprit": o.culprit, "action": o.action},
                "signatures": o.signatures,
                "explanation": o.explanation,
            }
        )
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_md(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        "# Diagnosis accuracy benchmark",
        "",
        f"Measured {result['measured_at']} with `python -m bench.accuracy` over {s['cases']} labeled cases of real logs "
        f"in `tests/fixtures/corpus/` (each case cites its sources in `label.yaml`). "
        "Offline `diagnose_paths`: the same signature and Xid detectors and the same attribution as the streams worker.",
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| category accuracy | {_pct(s['category_accuracy'])} | >= {_pct(TARGETS['category_accuracy'])} | "
        f"{'yes' if s['category_accuracy'] >= TARGETS['category_accuracy'] else 'NO'} |",
        f"| culprit accuracy | {_pct(s['culprit_accuracy'])} | >= {_pct(TARGETS['culprit_accuracy'])} | "
        f"{'yes' if s['culprit_accuracy'] >= TARGETS['culprit_accuracy'] else 'NO'} |",
        f"| non-`none` actions on the {s['healthy_cases']} healthy cases | {s['false_actions_on_healthy']} | "
        f"{int(TARGETS['false_actions_on_healthy'])} | "
        f"{'yes' if s['false_actions_on_healthy'] <= TARGETS['false_actions_on_healthy'] else 'NO'} |",
        f"| action accuracy | {_pct(s['action_accuracy'])} | | |",
        f"| exact match (category, culprit and action) | {_pct(s['exact_match'])} | | |",
        f"| diagnosed faults that are faults | {_pct(s['faults_flagged_that_are_faults'])} | | |",
        "",
        "## Per category",
        "",
        "| labeled category | cases | category right | culprit right | action right | diagnosed as |",
        "|---|---|---|---|---|---|",
    ]
    for cat, row in s["per_category"].items():
        diag = ", ".join(f"{k} {v}" for k, v in row["diagnosed_as"].items())
        lines.append(
            f"| {cat} | {row['cases']} | {row['category_correct']} | {row['culprit_correct']} | "
            f"{row['action_correct']} | {diag} |"
        )
    lines += ["", "## Misses", ""]
    if not result["misses"]:
        lines.append("None.")
    else:
        lines += ["| case | wrong | expected | got | evidence |", "|---|---|---|---|---|"]
        for m in result["misses"]:
            exp, got = m["expected"], m["got"]
            lines.append(
                f"| {m['case']} | {', '.join(m['wrong'])} | {exp['category']} / {exp['culprit'] or 'null'} / {exp['action']} | "
                f"{got['category']} / {got['culprit'] or 'null'} / {got['action']} | {_cell(', '.join(m['signatures']) or '-')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        outcomes = [run_case(case) for case in case_dirs(args.corpus)]
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not outcomes:
        print(f"error: no cases under {args.corpus}", file=sys.stderr)
        return 2
    for o in outcomes:
        mark = "ok  " if o.ok else "MISS"
        print(
            f"{mark} {o.case:44} {o.category:12} {o.culprit or '-':8} {o.action:17} "
            f"(label {o.label.category}/{o.label.culprit or '-'}/{o.label.action})"
        )
    summary = summarize(outcomes)
    result = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "targets": TARGETS,
        "summary": summary,
        "misses": misses(outcomes),
        "cases": [
            {
                "case": o.case,
                "files": o.files,
                "label": asdict(o.label),
                "got": {"category": o.category, "culprit": o.culprit, "action": o.action, "confidence": o.confidence},
                "signatures": o.signatures,
                "ok": o.ok,
            }
            for o in outcomes
        ],
    }
    print(
        f"\n{summary['cases']} cases: category {_pct(summary['category_accuracy'])}, "
        f"culprit {_pct(summary['culprit_accuracy'])}, action {_pct(summary['action_accuracy'])}, "
        f"non-none actions on {summary['healthy_cases']} healthy cases: {summary['false_actions_on_healthy']}; "
        f"targets {'met' if summary['targets_met'] else 'MISSED'}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "accuracy.md").write_text(render_md(result))
    print(f"wrote {args.out / 'accuracy.json'} and {args.out / 'accuracy.md'}")
    return 0 if summary["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
