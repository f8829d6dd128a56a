"""docs/benchmarks.md and the README's headline figures, from the result files under bench/results/<benchmark>/.

    python -m bench.render [--readme README.md] [--check]

Writes docs/benchmarks.md (every result, newest first per benchmark) and docs/benchmarks-headline.md
(the headline block, between the markers below); --readme replaces the marked block in that file too;
--check writes nothing and exits 1 where a file differs from what the results give.
tests/unit/test_bench_results.py fails the same way, so a figure in the docs is the figure in its file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import REPO, RESULTS, Stored, load
from schemas.errors import NotFound

PAGE = REPO / "docs" / "benchmarks.md"
HEADLINE = REPO / "docs" / "benchmarks-headline.md"
BEGIN = "<!-- headline-figures:begin -->"
END = "<!-- headline-figures:end -->"
COMMAND = "python -m bench.render"
MAX_HEADLINE_LINES = 12
MAX_LINE = 120

# Section order and what each benchmark measures; a benchmark not named here comes after these.
BENCHES: dict[str, str] = {
    "pipeline": "the whole pipeline against a simulated N-node x 8-GPU cluster with injected faults: detection and "
    "action latency, accuracy, the status quo beside each figure, and a scale search (`make bench`)",
    "scale_points": "single points of the scale scenario (nodes x streams workers, edge summaries every S s) "
    "without the search: lag, detection p95, CPU per component, GPUs per central core",
    "catchup": "a preloaded backlog of a whole fleet drained by 1, 2, ... streams workers",
    "accuracy": "diagnosis of the labelled corpus of real job logs: the dev split it was tuned on, the held-out "
    "test split by collection batch, leave-one-source-out on dev",
    "audit": "the audit trail at fleet scale on chDB: operator and Grafana queries on the old and the new layout",
    "repeat_faults": "GPU-hours lost to repeat faults (no progress, a bad node, a cause that follows the job) with "
    "trainmedic and in two status-quo worlds; and a model of predictive migration (reactive against migration at "
    "the next checkpoint, swept over lead time and precision)",
    "reliability": "the fault-injection tests of tests/reliability/ and what each measured after its assertions held",
    "producers": "the GPU producers' CPU and memory, the job-log tailer's throughput",
    "detectors": "the progress parser's and the hang and straggler detectors' throughput, in memory",
    "broker_history": "the embedded broker's CPU per fetch as its stored history grows",
    "slurm_rpc": "slurmctld RPCs of log discovery, extrapolated to 1,024 nodes, on both local Slurm versions",
    "fuzz": "coverage-guided fuzzing of the log and kernel-line parsers",
}


def number(v: float) -> str:
    """A figure as stored: every digit of the file, thousands separated (600.0 as 600)."""
    return format(int(v), ",") if float(v).is_integer() else format(v, ",")


def with_unit(v: float, unit: str) -> str:
    if unit == "count":
        return number(v)
    return f"{number(v)}x" if unit == "x" else f"{number(v)} {unit}"


def _cell(v: Any) -> str:
    text = number(v) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _where(where: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {_cell(v)}" for k, v in where.items())


def _machine(m: Mapping[str, Any]) -> str:
    parts = [m.get("cpu") or "CPU not recorded"]
    if m.get("cores"):
        parts.append(f"{m['cores']} cores")
    if m.get("mem_gb"):
        parts.append(f"{m['mem_gb']} GB")
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    return ", ".join(str(p) for p in parts)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> list[str]:
    """A Markdown table; the columns at the indexes `right` right-aligned (the numbers)."""
    align = ["---:" if i in right else "---" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows),
    ]


def figure_tables(doc: Mapping[str, Any]) -> list[str]:
    """The figures of a result as tables: one per set of `where` keys, a row per `where`, a column per figure;
    a verdict with the same keys becomes a column too (yes / **no**, the reason under the table)."""
    groups: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
    for f in doc["figures"]:
        groups.setdefault(tuple(f.get("where", {})), []).append(f)
    verdicts: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
    for v in doc["verdicts"]:
        verdicts.setdefault(tuple(v.get("where", {})), []).append(v)
    out: list[str] = []
    for keys, figs in groups.items():
        if not keys:
            rows = [[f["name"], with_unit(f["value"], f["unit"]), f.get("description", "")] for f in figs]
            out += [*_table(["figure", "value", "what"], rows, right=[1]), ""]
            continue
        # Columns in the order the figures were taken: one a row lacks goes after the one before it in another row.
        columns: list[tuple[str, str]] = []
        before: dict[str, tuple[str, str]] = {}
        for f in figs:
            w, col = json.dumps(f["where"], sort_keys=True), (f["name"], f["unit"])
            if col not in columns:
                columns.insert(columns.index(before[w]) + 1 if w in before else len(columns), col)
            before[w] = col
        vnames = list(dict.fromkeys(v["name"] for v in verdicts.pop(keys, [])))
        own = [v for v in doc["verdicts"] if tuple(v.get("where", {})) == keys]
        cells: dict[str, dict[str, Any]] = {}
        wheres: dict[str, Mapping[str, Any]] = {}
        for f in figs:
            w = json.dumps(f["where"], sort_keys=True)
            wheres.setdefault(w, f["where"])
            cells.setdefault(w, {})[f"{f['name']}\0{f['unit']}"] = f["value"]
        for v in own:
            w = json.dumps(v["where"], sort_keys=True)
            wheres.setdefault(w, v["where"])
            cells.setdefault(w, {})[f"{v['name']}\0verdict"] = "yes" if v["passed"] else "**no**"
        header = [*keys, *vnames, *(n if u == "count" else f"{n} ({u})" for n, u in columns)]
        rows = [
            [
                *(wh.get(k, "") for k in keys),
                *(cells[w].get(f"{n}\0verdict", "") for n in vnames),
                *(cells[w].get(f"{n}\0{u}", "") for n, u in columns),
            ]
            for w, wh in wheres.items()
        ]
        first = len(keys) + len(vnames)
        out += [*_table(header, rows, right=range(first, len(header))), ""]
        said = {f["name"]: f["description"] for f in figs if f.get("description")}
        out += [f"- {name}: {text}" for name, text in said.items()]
        if said:
            out.append("")
        failed = [v for v in own if not v["passed"] and v.get("detail")]
        out += [f"- {_where(v['where'])}: {v['name']}: no, {v['detail']}" for v in failed]
        if failed:
            out.append("")
    for vs in verdicts.values():
        rows = [[v["name"], _where(v.get("where", {})), "yes" if v["passed"] else "**no**", v["detail"]] for v in vs]
        out += [*_table(["verdict", "where", "held", "detail"], rows), ""]
    return out


def _parameters(params: Mapping[str, Any]) -> list[str]:
    shown = {k: v for k, v in params.items() if v not in (None, "", [], {})}
    if not shown:
        return []
    return ["Parameters: " + "; ".join(f"`{k}` {json.dumps(v, sort_keys=True)}" for k, v in shown.items()), ""]


def describe(r: Stored) -> list[str]:
    doc = r.doc
    rel = r.path.relative_to(REPO) if r.path.is_relative_to(REPO) else r.path
    lines = [
        f"Started {doc['started']}, commit `{doc['commit']}`"
        + (f", variant `{doc['variant']}`" if doc.get("variant") else "")
        + f"; {_machine(doc['machine'])}"
        + (f" ({doc['machine']['note']})" if doc["machine"].get("note") else "")
        + f". File: `{rel}`"
        + (f"; report: `{doc['report']}`" if doc.get("report") else "")
        + ".",
        "",
    ]
    if doc.get("notes"):
        lines += [doc["notes"], ""]
    return lines + _parameters(doc["parameters"]) + figure_tables(doc)


def _title(r: Stored) -> str:
    return f"{r.doc['started'][:10]}, `{r.doc['commit']}`" + (f", {r.variant}" if r.variant else "")


def render_page(results: Sequence[Stored]) -> str:
    names = [b for b in BENCHES if any(r.benchmark == b for r in results)]
    names += sorted({r.benchmark for r in results} - set(names))
    lines = [
        "# Benchmark results",
        "",
        "For developers and operators judging capacity: what trainmedic sustained, how fast it detected and acted "
        "and what it cost, as measured on this project's machines.",
        "",
        f"Generated by `{COMMAND}` from the result files under `bench/results/<benchmark>/` (one JSON file per "
        "run, in the format of `bench/results.schema.json`); do not edit it by hand. Each benchmark's newest "
        "result comes first, its earlier ones below it, folded. A figure's row says which part of the run it is "
        "about (`where`); units are in the column headers. Runs made with `--quick` (the smoke tests' size) are "
        "left out.",
        "",
        "## Headline",
        "",
        *headline_lines(results),
        "",
        "## Benchmarks",
        "",
        *(f"- [{b}](#{b}): {BENCHES.get(b, '')}".rstrip(": ") for b in names),
        "",
    ]
    for b in names:
        mine = sorted((r for r in results if r.benchmark == b and not r.quick), key=lambda r: r.sort_key, reverse=True)
        if not mine:
            continue
        lines += [f"## {b}", "", f"`python -m bench.{b}`: {BENCHES.get(b, '')}.".replace(": .", "."), ""]
        lines += [f"### Latest: {_title(mine[0])}", "", *describe(mine[0])]
        if len(mine) > 1:
            lines += ["### Earlier results", ""]
            for r in mine[1:]:
                lines += ["<details>", f"<summary>{_title(r).replace('`', '')}</summary>", "", *describe(r)]
                lines += ["</details>", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# --- the headline --------------------------------------------------------------------------------------------


class Missing(NotFound, LookupError):
    """A headline figure that no result file has."""


@dataclass(frozen=True)
class Found:
    value: float
    unit: str
    result: Stored

    @property
    def text(self) -> str:
        return with_unit(self.value, self.unit)

    @property
    def num(self) -> str:
        return number(self.value)

    @property
    def date(self) -> str:
        return str(self.result.doc["started"])[:10]


class Lookup:
    """Figures for the headline: the newest result of a benchmark (and variant) holding the figure."""

    def __init__(self, results: Sequence[Stored]) -> None:
        self.results = sorted((r for r in results if not r.quick), key=lambda r: r.sort_key, reverse=True)

    def _match(self, kind: str, benchmark: str, name: str, variant: str | None, where: Mapping[str, Any]) -> Any:
        for r in self.results:
            # variant None: any; "": the benchmark's default run (no variant)
            if r.benchmark != benchmark or (variant is not None and r.variant != (variant or None)):
                continue
            hits = [
                x
                for x in r.doc[kind]
                if x["name"] == name and all(x.get("where", {}).get(k) == v for k, v in where.items())
            ]
            if len(hits) > 1:  # a figure of the whole run over the same figure of its parts
                hits = [x for x in hits if set(x.get("where", {})) == set(where)]
            if len(hits) > 1:
                raise Missing(f"{benchmark} {name!r} {where}: {len(hits)} matches in {r.path.name}; name more of where")
            if hits:
                return hits[0], r
        raise Missing(f"no result of {benchmark}" + (f" ({variant})" if variant else "") + f" has {name!r} {where}")

    def fig(self, benchmark: str, name: str, variant: str | None = None, **where: Any) -> Found:
        f, r = self._match("figures", benchmark, name, variant, where)
        return Found(f["value"], f["unit"], r)

    def held(self, benchmark: str, name: str, variant: str | None = None, **where: Any) -> bool:
        v, _ = self._match("verdicts", benchmark, name, variant, where)
        return bool(v["passed"])


def _latency(q: Lookup) -> str:
    p50 = q.fig("pipeline", "detection p50, explicit faults", variant="")
    p95 = q.fig("pipeline", "detection p95, explicit faults", variant="")
    act = q.fig("pipeline", "action p50", variant="")
    return (
        f"- Detection at {p50.result.doc['parameters']['nodes']} nodes ({p50.date}), explicit faults (Xid, log line): "
        f"p50 {p50.text}, p95 {p95.text}; action p50 {act.text}"
    )


def _accuracy_pipeline(q: Lookup) -> str:
    cat = q.fig("pipeline", "category accuracy", variant="")
    cul = q.fig("pipeline", "culprit accuracy", variant="")
    inc = q.fig("pipeline", "incidents on healthy jobs", variant="")
    act = q.fig("pipeline", "actions on healthy jobs", variant="")
    return (
        f"- Same run: category right {cat.text}, culprit {cul.text}; on healthy jobs {inc.num} incidents, "
        f"{act.num} actions"
    )


def _scale(q: Lookup) -> str:
    at: dict[str, Any] = {"set": "final", "point": 4, "nodes": 3072, "workers": 1}
    core = q.fig("scale_points", "GPUs per central core", **at)
    p95 = q.fig("scale_points", "detection p95", **at)
    ok = "sustained" if q.held("scale_points", "sustained", **at) else "not sustained"
    return (
        f"- 3,072 nodes (24,576 GPUs), 1 worker, 2 cores ({core.date}): {ok}, {core.num} GPUs/central core, "
        f"detection p95 {p95.text}"
    )


def _scale_limit(q: Lookup) -> str:
    at: dict[str, Any] = {"set": "one_worker", "nodes": 5000, "workers": 1}
    lag = q.fig("scale_points", "lag max", **at)
    ok = "sustained" if q.held("scale_points", "sustained", **at) else "not sustained"
    return f"- 5,000 nodes on the same 2 cores ({lag.date}): {ok}, lag max {lag.text}"


def _catchup(q: Lookup) -> str:
    rate = q.fig("catchup", "drain rate", workers=2)
    up = q.fig("catchup", "speed-up over 1 worker", workers=2)
    total = q.fig("catchup", "backlog records")
    inc = q.fig("catchup", "incidents", workers=2)
    return (
        f"- Catch-up of a {total.num}-record backlog ({rate.date}): {rate.text} with 2 workers ({up.text} one), "
        f"{inc.num} false incidents"
    )


def _diagnosis(q: Lookup) -> str:
    at = {"split": "test", "subset": "batch td"}
    cat = q.fig("accuracy", "category accuracy", variant="", **at)
    act = q.fig("accuracy", "action accuracy", variant="", **at)
    called = q.fig("accuracy", "failures called healthy", variant="", **at)
    failures = q.fig("accuracy", "failure cases", variant="", **at)
    return (
        f"- Diagnosis, held-out batch td ({cat.date}): category {cat.text}, action {act.text}, "
        f"{called.num} of {failures.num} failures called healthy"
    )


def _audit(q: Lookup) -> str:
    job = q.fig("audit", "p95", layout="after", query="audit job")
    node = q.fig("audit", "p95", layout="after", query="audit node")
    return f"- Audit queries, 90 days of 5,000 nodes ({job.date}): `audit job` p95 {job.text}, `audit node` {node.text}"


def _producers(q: Lookup) -> str:
    cpu = q.fig("producers", "CPU", producer="nvml")
    rss = q.fig("producers", "RSS", producer="nvml")
    tail = q.fig("producers", "lines", producer="job-log tailer")
    return f"- NVML producer, 8 GPUs at 1 Hz: {cpu.text}, {rss.text}; job-log tailer {tail.text} ({cpu.date})"


HEADLINES: tuple[Callable[[Lookup], str], ...] = (
    _latency,
    _accuracy_pipeline,
    _scale,
    _scale_limit,
    _catchup,
    _diagnosis,
    _audit,
    _producers,
)


def headline_lines(results: Sequence[Stored]) -> list[str]:
    q = Lookup(results)
    return [line(q) for line in HEADLINES]


def render_headline(results: Sequence[Stored]) -> str:
    """The block for the README, markers included."""
    lines = [BEGIN, f"<!-- generated by `{COMMAND}` from bench/results/; edit bench/render.py, not this -->"]
    # A link from the README at the top of the repository.
    lines += [
        *headline_lines(results),
        "- Every figure, its run and its machine: [docs/benchmarks.md](docs/benchmarks.md)",
    ]
    body = lines[2:]
    if len(body) > MAX_HEADLINE_LINES or any(len(x) > MAX_LINE for x in body):
        long = [x for x in body if len(x) > MAX_LINE]
        raise ValueError(f"headline: {len(body)} lines (at most {MAX_HEADLINE_LINES}), too long: {long}")
    return "\n".join([*lines, END]) + "\n"


def replace_block(text: str, block: str) -> str:
    """text with the part from BEGIN to END (markers included) replaced by block."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[:start] + block.rstrip("\n") + text[stop + len(END) :]


def outputs(results: Sequence[Stored], readmes: Sequence[Path] = ()) -> dict[Path, str]:
    """What each generated file should hold."""
    headline = render_headline(results)
    out = {PAGE: render_page(results), HEADLINE: headline}
    for path in readmes:
        out[path] = replace_block(path.read_text(), headline)
    return out


def stale(expected: Mapping[Path, str]) -> list[str]:
    """A unified diff per file that differs from what it should hold."""
    diffs = []
    for path, text in expected.items():
        have = path.read_text() if path.exists() else ""
        if have != text:
            name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            diffs.append(
                "".join(difflib.unified_diff(have.splitlines(True), text.splitlines(True), name, f"{name} (rendered)"))
            )
    return diffs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of <benchmark>/*.json")
    p.add_argument("--readme", type=Path, action="append", default=[], help="also replace the marked block here")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file is out of date")
    a = p.parse_args(argv)
    expected = outputs(load(a.results), [r.resolve() for r in a.readme])
    if a.check:
        diffs = stale(expected)
        for d in diffs:
            print(d)
        if diffs:
            print(f"out of date: run `{COMMAND}`" + "".join(f" --readme {r}" for r in a.readme), file=sys.stderr)
        return 1 if diffs else 0
    for path, text in expected.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
