"""Diagnosis accuracy benchmark (a report, not a gate): prints figures and writes bench/results/accuracy.{json,md}
and the result in the common format, bench/results/accuracy/<date>-<commit>.json (bench/results.py).

Runs `trainmedic.ops.diagnose.diagnose_paths` over every case of the labeled corpus of real logs,
tests/fixtures/corpus/<split>/<case>/ (log files plus label.yaml, see the corpus README), and
compares the diagnosis with the label. The corpus is split once, by source: `dev/` is what rules
are tuned on, `test/` is held out and only reported. Per split, overall and per labeled category:

- category accuracy: diagnosed category == labeled category;
- action accuracy: the action == labeled action, the action being what the default policy
  (streams/policies/default.yaml, loaded as the streams worker loads it) decides for the diagnosed
  incident: attribution states facts, policy alone chooses the action;
- culprit accuracy: diagnosed culprit node == labeled culprit (null == null counts as right) and,
  where the label has `culprit_rank`, the diagnosed rank == that rank;
- culprit where the log names it: the same, over the cases whose label has a culprit or a rank;
- false actions on healthy: healthy cases whose action is not `none`;
- failures called `healthy`: cases labelled anything but healthy that were diagnosed healthy (a
  dead job left unnoticed: the worst miss);
- `unknown`: cases labeled unknown ("needs a person"), any action recommended on them, and how
  often the verdict is `unknown` (a failure called unknown is a category miss, so moving verdicts
  to `unknown` does not raise the score).

The test split is reported per batch too (`ta_`, `tb_`, ... case prefixes: one collection round
each). On dev, **leave-one-source-out**: every case diagnosed again without the log signatures
written from its own sources (a signature's `source` and the case's `source` URLs compared as
threads, repositories or pages: `source_unit`), which measures how the catalog does on a source it
was not written from - the number to iterate on, reported beside dev and test.

A label's optional `diagnose_args` (for example `{nodelist: "gpu[01-04]", ranks_per_node: 8}`) are
passed to `diagnose_paths` when its signature accepts them; the others are listed as ignored.

The terminal shows the dev split case by case and the test split only as totals: the test split's
misses are written to the report files alone, so that whoever tunes the rules does not see them.
`--split all` writes accuracy.{json,md}; `--split dev` or `test` writes accuracy-<split>.{json,md}
(so a dev-only run never rewrites the committed two-split report).

Exit status 0 whatever the figures; 2 when the corpus is malformed (bad label, case without logs,
split without cases).

Run: .venv/bin/python -m bench.accuracy [--split dev|test|all] [--corpus tests/fixtures/corpus] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import figures, results
from bench.machine import machine
from schemas.errors import UsageError
from schemas.vocab import ACTIONS, CATEGORIES
from schemas.yamlsafe import YamlError, load_yaml
from streams.catalog import Signature, default_signatures
from streams.policy import Policy, load_policy
from trainmedic.ops.diagnose import DiagnoseError, diagnose_paths

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "corpus"
RESULTS = REPO / "bench" / "results"
SPLITS = ("dev", "test")
LABEL_FILE = "label.yaml"
TARGETS: dict[str, float] = {
    "category_accuracy": 0.95,
    "action_accuracy": 0.95,
    "culprit_named_accuracy": 0.95,
    "false_actions_on_healthy": 0,
    "failures_called_healthy_rate": 0.05,
}
# `unknown` ("needs a person", issue 13) is accepted whether or not schemas.vocab has it yet;
# once it does, this is CATEGORIES itself.
LABEL_CATEGORIES: tuple[str, ...] = CATEGORIES if "unknown" in CATEGORIES else (*CATEGORIES, "unknown")
# The corpus README's labelling rule: the action each category calls for. Interconnect allows
# drain_and_requeue where the text names the node whose own adapter or port failed.
RULE_ACTIONS: dict[str, frozenset[str]] = {
    "gpu_hardware": frozenset({"drain_and_requeue"}),
    "node": frozenset({"drain_and_requeue"}),
    "interconnect": frozenset({"requeue", "drain_and_requeue"}),
    "hang": frozenset({"requeue"}),
    "user_code": frozenset({"stop"}),
    "oom": frozenset({"stop"}),
    "numerical": frozenset({"stop"}),
    "storage": frozenset({"stop"}),
    "unknown": frozenset({"none"}),
    "healthy": frozenset({"none"}),
}
LABEL_KEYS = {"category", "culprit", "culprit_rank", "action", "source", "notes", "diagnose_args"}
# A test case's batch: its folder name's prefix (ta_, tb_, ...), one per collection round.
BATCH = re.compile(r"^(t[a-z])_")
NO_BATCH = "-"
# Forms of a GitHub URL that name one thread; any other GitHub path is the repository's own files.
_GITHUB_THREAD = re.compile(r"^/([^/]+)/([^/]+)/(issues|pull|discussions)/(\d+)")
_GITHUB_REPO = re.compile(r"^/([^/]+)/([^/]+)")


class CorpusError(UsageError, ValueError):
    pass


@dataclass(frozen=True)
class Label:
    category: str
    culprit: str | None
    action: str
    source: list[str]
    notes: str
    culprit_rank: int | None = None
    diagnose_args: dict[str, Any] = field(default_factory=dict)

    @property
    def names_culprit(self) -> bool:
        return self.culprit is not None or self.culprit_rank is not None


@dataclass(frozen=True)
class Outcome:
    case: str
    files: list[str]
    label: Label
    category: str
    culprit: str | None
    culprit_rank: int | None
    action: str
    confidence: float
    signatures: list[str]
    explanation: str
    ignored_args: list[str]
    left_out: list[str] = field(default_factory=list)  # signatures left out (leave-one-source-out)

    @property
    def category_ok(self) -> bool:
        return self.category == self.label.category

    @property
    def culprit_ok(self) -> bool:
        rank_ok = self.label.culprit_rank is None or self.culprit_rank == self.label.culprit_rank
        return self.culprit == self.label.culprit and rank_ok

    @property
    def culprit_named_ok(self) -> bool:
        """Over a label that names a culprit: each named part (node, rank) is what was diagnosed."""
        node_ok = self.label.culprit is None or self.culprit == self.label.culprit
        rank_ok = self.label.culprit_rank is None or self.culprit_rank == self.label.culprit_rank
        return self.label.names_culprit and node_ok and rank_ok

    @property
    def action_ok(self) -> bool:
        return self.action == self.label.action

    @property
    def failure_called_healthy(self) -> bool:
        return self.label.category != "healthy" and self.category == "healthy"

    @property
    def ok(self) -> bool:
        return self.category_ok and self.culprit_ok and self.action_ok


def load_label(path: Path) -> Label:
    try:
        raw = load_yaml(path.read_text(), str(path))
    except (OSError, YamlError) as exc:
        raise CorpusError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise CorpusError(f"{path}: expected a mapping")
    missing = {"category", "culprit", "action", "source", "notes"} - set(raw)
    if missing:
        raise CorpusError(f"{path}: missing {', '.join(sorted(missing))}")
    unknown_keys = set(raw) - LABEL_KEYS
    if unknown_keys:
        raise CorpusError(f"{path}: unknown keys {', '.join(sorted(unknown_keys))}")
    category, culprit, action, source = raw["category"], raw["culprit"], raw["action"], raw["source"]
    rank, args = raw.get("culprit_rank"), raw.get("diagnose_args") or {}
    if category not in LABEL_CATEGORIES:
        raise CorpusError(f"{path}: category {category!r} is not one of {', '.join(LABEL_CATEGORIES)}")
    if action not in ACTIONS:
        raise CorpusError(f"{path}: action {action!r} is not one of {', '.join(ACTIONS)}")
    if culprit is not None and not isinstance(culprit, str):
        raise CorpusError(f"{path}: culprit must be a node name or null")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise CorpusError(f"{path}: culprit_rank must be a rank number (int >= 0) or absent")
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise CorpusError(f"{path}: diagnose_args must be a mapping of argument names to values")
    if not isinstance(source, list) or not source or not all(isinstance(s, str) for s in source):
        raise CorpusError(f"{path}: source must be a non-empty list of URLs")
    return Label(
        category=category,
        culprit=culprit,
        action=action,
        source=source,
        notes=str(raw["notes"]).strip(),
        culprit_rank=rank,
        diagnose_args=dict(args),
    )


def rule_warning(case: str, label: Label) -> str | None:
    """A label whose action is not what the labelling rule gives its category (reported, not fatal)."""
    allowed = RULE_ACTIONS.get(label.category)
    if allowed is None or label.action in allowed:
        return None
    return f"{case}: {label.category} labeled {label.action}, the rule gives {' or '.join(sorted(allowed))}"


def case_dirs(split_dir: Path) -> list[Path]:
    return sorted(p for p in split_dir.iterdir() if p.is_dir() and (p / LABEL_FILE).is_file())


def case_files(case: Path) -> list[Path]:
    return sorted(p for p in case.iterdir() if p.is_file() and p.name != LABEL_FILE)


def accepted_args() -> set[str] | None:
    """Keyword arguments diagnose_paths takes besides the paths; None when it takes any (**kwargs)."""
    params = list(inspect.signature(diagnose_paths).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds}


def source_unit(url: str) -> str:
    """The source a URL belongs to, as the corpus is split by it (corpus README): one issue or
    pull-request thread, one repository's committed files, one web page."""
    parts = urlsplit(url.strip())
    host = parts.netloc.lower().removeprefix("www.")
    if host == "github.com":
        if m := _GITHUB_THREAD.match(parts.path):
            # Issues and pull requests share one numbering: either is the same thread.
            return f"github.com/{m[1]}/{m[2]}/issues/{m[4]}".lower()
        if m := _GITHUB_REPO.match(parts.path):
            return f"github.com/{m[1]}/{m[2]}".lower()
    return f"{host}{parts.path.rstrip('/')}".lower()


def batch_of(case: str) -> str:
    m = BATCH.match(case)
    return m.group(1) if m else NO_BATCH


def without_own_sources(label: Label, catalog: tuple[Signature, ...]) -> tuple[list[Signature], list[str]]:
    """The log-signature catalog less the entries written from this case's own sources
    (leave-one-source-out), and the ids left out."""
    units = {source_unit(u) for u in label.source}
    kept = [sig for sig in catalog if source_unit(sig.source) not in units]
    return kept, [sig.id for sig in catalog if source_unit(sig.source) in units]


def run_case(
    case: Path, accepted: set[str] | None, policy: Policy | None = None, leave_own_sources_out: bool = False
) -> Outcome:
    label = load_label(case / LABEL_FILE)
    files = case_files(case)
    if not files:
        raise CorpusError(f"{case}: no log files")
    kwargs: dict[str, Any] = {
        k: v for k, v in label.diagnose_args.items() if k != "policy" and (accepted is None or k in accepted)
    }
    ignored = sorted(set(label.diagnose_args) - set(kwargs))
    left_out: list[str] = []
    if leave_own_sources_out:
        kwargs["signatures"], left_out = without_own_sources(label, default_signatures())
    try:
        report = diagnose_paths(files, policy=policy or load_policy(), **kwargs)
    except DiagnoseError as exc:
        # The tool refusing a real log is a miss of the tool, not a malformed corpus.
        report = {
            "category": "error",
            "culprit": None,
            "culprit_rank": None,
            "action": "error",
            "confidence": 0.0,
            "evidence": [],
            "explanation": f"diagnose error: {exc}",
        }
    return Outcome(
        case=case.name,
        files=[p.name for p in files],
        label=label,
        category=report["category"],
        culprit=report["culprit"],
        culprit_rank=report.get("culprit_rank"),
        action=report["action"],
        confidence=report["confidence"],
        signatures=sorted({e["signature"] for e in report["evidence"]}),
        explanation=report["explanation"],
        ignored_args=ignored,
        left_out=left_out,
    )


def _ratio(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def _figures(rows: list[Outcome]) -> dict[str, Any]:
    named = [o for o in rows if o.label.names_culprit]
    return {
        "cases": len(rows),
        "category_correct": sum(o.category_ok for o in rows),
        "action_correct": sum(o.action_ok for o in rows),
        "culprit_correct": sum(o.culprit_ok for o in rows),
        "culprit_named_cases": len(named),
        "culprit_named_correct": sum(o.culprit_named_ok for o in named),
    }


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    n = len(outcomes)
    figures = _figures(outcomes)
    per_category: dict[str, dict[str, Any]] = {}
    for cat in LABEL_CATEGORIES:
        rows = [o for o in outcomes if o.label.category == cat]
        if rows:
            per_category[cat] = {
                **_figures(rows),
                "diagnosed_as": dict(Counter(o.category for o in rows).most_common()),
            }
    healthy = [o for o in outcomes if o.label.category == "healthy"]
    unknown = [o for o in outcomes if o.label.category == "unknown"]
    failures = [o for o in outcomes if o.label.category != "healthy"]
    called_unknown = [o for o in outcomes if o.category == "unknown"]
    flagged = [o for o in outcomes if o.category != "healthy"]
    summary: dict[str, Any] = {
        **figures,
        "category_accuracy": _ratio(figures["category_correct"], n),
        "action_accuracy": _ratio(figures["action_correct"], n),
        "culprit_accuracy": _ratio(figures["culprit_correct"], n),
        "culprit_named_accuracy": _ratio(figures["culprit_named_correct"], figures["culprit_named_cases"]),
        "exact_match": _ratio(sum(o.ok for o in outcomes), n),
        # Precision view: of the cases diagnosed as something other than healthy, how many were.
        "faults_flagged_that_are_faults": _ratio(sum(o.label.category != "healthy" for o in flagged), len(flagged)),
        "healthy_cases": len(healthy),
        "false_actions_on_healthy": sum(o.action != "none" for o in healthy),
        "unknown_cases": len(unknown),
        "unknown_correct": sum(o.category_ok for o in unknown),
        "actions_on_unknown": sum(o.action != "none" for o in unknown),
        # A failure called healthy is the worst miss: the job would sit dead, unnoticed.
        "failure_cases": len(failures),
        "failures_called_healthy": sum(o.failure_called_healthy for o in failures),
        "failures_called_healthy_rate": _ratio(sum(o.failure_called_healthy for o in failures), len(failures)),
        # How often the verdict is "needs a person"; a failure called unknown is a category miss.
        "diagnosed_unknown": len(called_unknown),
        "unknown_rate": _ratio(len(called_unknown), n),
        "failures_called_unknown": sum(o.label.category not in ("healthy", "unknown") for o in called_unknown),
        "per_category": per_category,
    }
    summary["targets_met"] = all(
        summary[k] is not None and summary[k] >= TARGETS[k]
        for k in ("category_accuracy", "action_accuracy", "culprit_named_accuracy")
    ) and (summary["false_actions_on_healthy"] <= TARGETS["false_actions_on_healthy"])
    return summary


def misses(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    rows = []
    for o in outcomes:
        if o.ok:
            continue
        checks = (("category", o.category_ok), ("culprit", o.culprit_ok), ("action", o.action_ok))
        rows.append(
            {
                "case": o.case,
                "wrong": [f for f, ok in checks if not ok],
                "expected": {
                    "category": o.label.category,
                    "culprit": o.label.culprit,
                    "culprit_rank": o.label.culprit_rank,
                    "action": o.label.action,
                },
                "got": {
                    "category": o.category,
                    "culprit": o.culprit,
                    "culprit_rank": o.culprit_rank,
                    "action": o.action,
                },
                "signatures": o.signatures,
                "explanation": o.explanation,
            }
        )
    return rows


def by_batch(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """A summary per collection batch (ta, tb, ...), when the split has batches."""
    batches: dict[str, list[Outcome]] = {}
    for o in outcomes:
        batches.setdefault(batch_of(o.case), []).append(o)
    if set(batches) == {NO_BATCH}:
        return {}
    return {name: summarize(rows) for name, rows in sorted(batches.items())}


def leave_one_source_out(split_dir: Path, accepted: set[str] | None) -> dict[str, Any]:
    """Every case diagnosed without the log signatures written from its own sources: how the
    catalog does on a source it was not written from. The number to iterate on."""
    policy = load_policy()
    outcomes = [run_case(case, accepted, policy, leave_own_sources_out=True) for case in case_dirs(split_dir)]
    return {
        "summary": summarize(outcomes),
        "signatures_left_out": {o.case: o.left_out for o in outcomes if o.left_out},
        "_outcomes": outcomes,
    }


def evaluate_split(split_dir: Path, accepted: set[str] | None) -> dict[str, Any]:
    if not split_dir.is_dir():
        raise CorpusError(f"{split_dir}: no such split directory")
    policy = load_policy()  # the default policy, validated as the streams worker validates it
    outcomes = [run_case(case, accepted, policy) for case in case_dirs(split_dir)]
    if not outcomes:
        raise CorpusError(f"{split_dir}: no cases (a case is a folder with a {LABEL_FILE})")
    return {
        "corpus": str(split_dir.relative_to(REPO) if split_dir.is_relative_to(REPO) else split_dir),
        "summary": summarize(outcomes),
        "batches": by_batch(outcomes),
        "misses": misses(outcomes),
        "label_warnings": [w for o in outcomes if (w := rule_warning(o.case, o.label))],
        "ignored_diagnose_args": {o.case: o.ignored_args for o in outcomes if o.ignored_args},
        "cases": [
            {
                "case": o.case,
                "files": o.files,
                "label": asdict(o.label),
                "got": {
                    "category": o.category,
                    "culprit": o.culprit,
                    "culprit_rank": o.culprit_rank,
                    "action": o.action,
                    "confidence": o.confidence,
                },
                "signatures": o.signatures,
                "ok": o.ok,
            }
            for o in outcomes
        ],
        "_outcomes": outcomes,
    }


# --- rendering ------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _met(value: float | None, target: float, at_most: bool = False) -> str:
    if value is None:
        return "n/a"
    return "yes" if (value <= target if at_most else value >= target) else "NO"


def _who(culprit: str | None, rank: int | None) -> str:
    return (culprit or "null") + (f" (rank {rank})" if rank is not None else "")


def _frac(right: int, cases: int) -> str:
    return f"{right}/{cases}" if cases else "-"


def render_split_md(name: str, res: dict[str, Any]) -> list[str]:
    s = res["summary"]
    lines = [
        f"## Split `{name}` ({s['cases']} cases, `{res['corpus']}`)",
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| category accuracy | {_pct(s['category_accuracy'])} | >= {_pct(TARGETS['category_accuracy'])} | "
        f"{_met(s['category_accuracy'], TARGETS['category_accuracy'])} |",
        f"| action accuracy | {_pct(s['action_accuracy'])} | >= {_pct(TARGETS['action_accuracy'])} | "
        f"{_met(s['action_accuracy'], TARGETS['action_accuracy'])} |",
        f"| culprit where the log names it ({s['culprit_named_cases']} cases) | {_pct(s['culprit_named_accuracy'])} | "
        f">= {_pct(TARGETS['culprit_named_accuracy'])} | "
        f"{_met(s['culprit_named_accuracy'], TARGETS['culprit_named_accuracy'])} |",
        f"| non-`none` actions on the {s['healthy_cases']} healthy cases | {s['false_actions_on_healthy']} | "
        f"{int(TARGETS['false_actions_on_healthy'])} | "
        f"{_met(s['false_actions_on_healthy'], TARGETS['false_actions_on_healthy'], at_most=True)} |",
        f"| failures called `healthy` ({s['failure_cases']} failures) | "
        f"{s['failures_called_healthy']} ({_pct(s['failures_called_healthy_rate'])}) | "
        f"<= {_pct(TARGETS['failures_called_healthy_rate'])} | "
        f"{_met(s['failures_called_healthy_rate'], TARGETS['failures_called_healthy_rate'], at_most=True)} |",
        f"| verdict `unknown` (needs a person) | {s['diagnosed_unknown']} ({_pct(s['unknown_rate'])}); "
        f"{s['failures_called_unknown']} of them failures of a known class | | |",
        f"| culprit accuracy, all cases (null == null is right) | {_pct(s['culprit_accuracy'])} | | |",
        f"| `unknown` cases diagnosed unknown | {_frac(s['unknown_correct'], s['unknown_cases'])} | | |",
        f"| actions recommended on `unknown` cases | {s['actions_on_unknown']} | | |",
        f"| exact match (category, culprit and action) | {_pct(s['exact_match'])} | | |",
        f"| diagnosed faults that are faults | {_pct(s['faults_flagged_that_are_faults'])} | | |",
        "",
        "| labeled category | cases | category right | action right | culprit right | culprit named: right | diagnosed as |",
        "|---|---|---|---|---|---|---|",
    ]
    for cat, row in s["per_category"].items():
        diag = ", ".join(f"{k} {v}" for k, v in row["diagnosed_as"].items())
        lines.append(
            f"| {cat} | {row['cases']} | {row['category_correct']} | {row['action_correct']} | "
            f"{row['culprit_correct']} | {_frac(row['culprit_named_correct'], row['culprit_named_cases'])} | {diag} |"
        )
    if res.get("loso"):
        lo = res["loso"]["summary"]
        lines += [
            "",
            "### Leave-one-source-out",
            "",
            "Each case diagnosed without the log signatures written from its own sources "
            f"({len(res['loso']['signatures_left_out'])} cases lost at least one): how the catalog does on a "
            "source it was not written from.",
            "",
            "| measure | all signatures | own sources left out |",
            "|---|---|---|",
            f"| category accuracy | {_pct(s['category_accuracy'])} | {_pct(lo['category_accuracy'])} |",
            f"| action accuracy | {_pct(s['action_accuracy'])} | {_pct(lo['action_accuracy'])} |",
            f"| culprit where named | {_pct(s['culprit_named_accuracy'])} | {_pct(lo['culprit_named_accuracy'])} |",
            f"| failures called `healthy` | {s['failures_called_healthy']} | {lo['failures_called_healthy']} |",
            f"| actions on healthy | {s['false_actions_on_healthy']} | {lo['false_actions_on_healthy']} |",
        ]
    if res.get("batches"):
        lines += [
            "",
            "### Per batch",
            "",
            "| batch | cases | category | action | culprit where named | failures called healthy "
            "| actions on healthy | verdict unknown |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for batch, b in res["batches"].items():
            lines.append(
                f"| {batch} | {b['cases']} | {_pct(b['category_accuracy'])} | {_pct(b['action_accuracy'])} | "
                f"{_frac(b['culprit_named_correct'], b['culprit_named_cases'])} | "
                f"{b['failures_called_healthy']}/{b['failure_cases']} | "
                f"{b['false_actions_on_healthy']}/{b['healthy_cases']} | {b['diagnosed_unknown']} |"
            )
    lines += ["", f"### Misses ({len(res['misses'])})", ""]
    if not res["misses"]:
        lines.append("None.")
    else:
        lines += ["| case | wrong | expected | got | evidence |", "|---|---|---|---|---|"]
        for m in res["misses"]:
            exp, got = m["expected"], m["got"]
            lines.append(
                f"| {m['case']} | {', '.join(m['wrong'])} | "
                f"{exp['category']} / {_who(exp['culprit'], exp['culprit_rank'])} / {exp['action']} | "
                f"{got['category']} / {_who(got['culprit'], got['culprit_rank'])} / {got['action']} | "
                f"{_cell(', '.join(m['signatures']) or '-')} |"
            )
    if res["label_warnings"]:
        lines += ["", "Labels whose action is not the labelling rule's:", ""]
        lines += [f"- {w}" for w in res["label_warnings"]]
    if res["ignored_diagnose_args"]:
        lines += ["", "`diagnose_args` this diagnose does not take (ignored):", ""]
        lines += [f"- {case}: {', '.join(args)}" for case, args in res["ignored_diagnose_args"].items()]
    return lines


def render_md(result: dict[str, Any]) -> str:
    lines = [
        "# Diagnosis accuracy benchmark",
        "",
        f"Measured {result['measured_at']} with `python -m bench.accuracy --split {result['split']}` "
        "over the labeled corpus of real logs in `tests/fixtures/corpus/` (each case cites its sources in "
        "`label.yaml`). Offline `diagnose_paths`. `dev` is the split rules are tuned on; `test` is held out, "
        "split from dev by source, and only reported.",
        "",
    ]
    for name, res in result["splits"].items():
        lines += [*render_split_md(name, res), ""]
    return "\n".join(lines)


def _totals(name: str, s: dict[str, Any]) -> str:
    return (
        f"{name}: {s['cases']} cases: category {_pct(s['category_accuracy'])}, action {_pct(s['action_accuracy'])}, "
        f"culprit where named {_pct(s['culprit_named_accuracy'])} ({s['culprit_named_cases']} cases), "
        f"non-none actions on {s['healthy_cases']} healthy: {s['false_actions_on_healthy']}, "
        f"failures called healthy {s['failures_called_healthy']}/{s['failure_cases']}, "
        f"verdict unknown {s['diagnosed_unknown']} ({_pct(s['unknown_rate'])}), "
        f"unknown labels {_frac(s['unknown_correct'], s['unknown_cases'])}; "
        f"targets {'met' if s['targets_met'] else 'MISSED'}"
    )


def print_dev(res: dict[str, Any]) -> None:
    for o in res["_outcomes"]:
        mark = "ok  " if o.ok else "MISS"
        print(
            f"{mark} {o.case:44} {o.category:12} {_who(o.culprit, o.culprit_rank):10} {o.action:17} "
            f"(label {o.label.category}/{_who(o.label.culprit, o.label.culprit_rank)}/{o.label.action})"
        )
    for cat, row in res["summary"]["per_category"].items():
        print(
            f"  {cat:13} {row['cases']:3} cases: category {row['category_correct']}, action {row['action_correct']}, "
            f"culprit where named {_frac(row['culprit_named_correct'], row['culprit_named_cases'])}"
        )
    for w in res["label_warnings"]:
        print(f"label warning: {w}")


def _public(res: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in res.items() if k not in ("_outcomes", "loso")}
    if res.get("loso"):
        out["leave_one_source_out"] = {k: v for k, v in res["loso"].items() if k != "_outcomes"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=(*SPLITS, "all"), default="all")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="the folder holding dev/ and test/")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = results.now()
    splits = SPLITS if args.split == "all" else (args.split,)
    accepted = accepted_args()
    try:
        outcomes = {name: evaluate_split(args.corpus / name, accepted) for name in splits}
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "dev" in outcomes:
        outcomes["dev"]["loso"] = leave_one_source_out(args.corpus / "dev", accepted)
        print_dev(outcomes["dev"])
    for name, res in outcomes.items():
        # The test split only as totals: its cases stay out of sight of whoever tunes the rules.
        print(_totals(name, res["summary"]))
        if res.get("loso"):
            print(_totals(f"{name} (leave-one-source-out)", res["loso"]["summary"]))
        for batch, summary in res["batches"].items():
            print(_totals(f"{name} batch {batch}", summary))
        if name == "test" and res["label_warnings"]:
            print(f"test: {len(res['label_warnings'])} label warnings (see the report files)")
    result = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "split": args.split,
        "machine": machine(),
        "targets": TARGETS,
        "splits": {name: _public(res) for name, res in outcomes.items()},
    }
    stem = "accuracy" if args.split == "all" else f"accuracy-{args.split}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(render_md(result))
    common = results.record(
        "accuracy",
        figures.accuracy(result),
        root=args.out,
        started=started,
        machine=result["machine"],
        details=result,
        variant=None if args.split == "all" else args.split,
        report=args.out / f"{stem}.md",
    )
    print(f"wrote {args.out / (stem + '.json')}, {args.out / (stem + '.md')} and {common}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
