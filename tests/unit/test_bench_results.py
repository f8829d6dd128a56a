"""bench/results/<benchmark>/*.json: every result follows bench/results.schema.json, its figures are the ones
its benchmark's own report gives (bench/figures.py), and docs/benchmarks.md and the headline block quote
exactly these figures (re-rendered here and compared with the files)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench import figures, render, results
from bench.results import RESULTS, Summary

FILES = results.result_files()
NAME = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})-(?P<commit>[0-9a-f]{7,40}(-dirty)?|unknown)(-(?P<rest>.+))?\.json")


def _rel(path: Path) -> str:
    return str(path.relative_to(RESULTS))


def test_there_are_results() -> None:
    assert FILES, f"no result files under {RESULTS}/<benchmark>/"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_result_follows_the_schema(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert results.errors(doc) == []
    assert doc["benchmark"] == path.parent.name, "a result lives in the folder of its benchmark"
    m = NAME.fullmatch(path.name)
    assert m, f"{path.name}: not <date>-<commit>[-<variant>][-N].json"
    assert m["date"] == doc["started"][:10] and m["commit"] == doc["commit"]
    if doc.get("variant"):
        assert (m["rest"] or "").startswith(doc["variant"]), path.name


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_figures_are_those_of_the_benchmarks_own_report(path: Path) -> None:
    """What bench/figures.py takes from the run's report (kept in `details`) is what the file says; a result
    assembled by hand from several runs has no one report to take them from."""
    doc = json.loads(path.read_text())
    details = dict(doc.get("details") or {})
    source = details.pop("converted_from", {})
    if source.get("hand_assembled"):
        pytest.skip("assembled by hand from several runs")
    summary: Summary = getattr(figures, doc["benchmark"])(details)
    assert doc["figures"] == [f.as_json() for f in summary.figures]
    assert doc["verdicts"] == [v.as_json() for v in summary.verdicts]
    assert doc["parameters"] == json.loads(json.dumps(summary.parameters, default=str))


def test_docs_quote_the_result_files() -> None:
    readme = render.REPO / "README.md"
    with_block = [readme] if render.BEGIN in readme.read_text() else []
    diffs = render.stale(render.outputs(results.load(), with_block))
    command = render.COMMAND + "".join(f" --readme {p.name}" for p in with_block)
    assert not diffs, f"the docs differ from bench/results/; run `{command}`:\n" + "\n".join(diffs)[-6000:]


def test_headline_is_short() -> None:
    block = render.render_headline(results.load()).splitlines()
    assert block[0] == render.BEGIN and block[-1] == render.END
    body = block[2:-1]
    assert len(body) <= render.MAX_HEADLINE_LINES
    assert all(len(line) <= render.MAX_LINE for line in body)


def test_page_says_whom_it_is_for() -> None:
    first = render.render_page(results.load()).split("\n\n")[1]
    assert first.startswith("For developers and operators judging capacity")


def test_readme_block_is_replaced_and_the_rest_kept() -> None:
    text = f"# T\n\nbefore\n{render.BEGIN}\nold figures\n{render.END}\nafter\n"
    block = f"{render.BEGIN}\n- new\n{render.END}\n"
    assert render.replace_block(text, block) == f"# T\n\nbefore\n{render.BEGIN}\n- new\n{render.END}\nafter\n"
    with pytest.raises(ValueError, match="block"):
        render.replace_block("# no markers\n", block)


def test_a_headline_figure_no_result_has_is_an_error() -> None:
    q = render.Lookup(results.load())
    with pytest.raises(render.Missing):
        q.fig("pipeline", "no such figure")


def _summary() -> Summary:
    s = Summary(parameters={"quick": False})
    s.figure("detection p95", 1.5, "s", nodes=256)
    s.figure("not measured", None, "s")
    s.figure("not a number", float("nan"), "s")
    s.verdict("sustained", True, "ok", nodes=256)
    return s


def test_record_writes_a_checked_result_under_the_benchmark(tmp_path: Path) -> None:
    machine: dict[str, Any] = {"cpu": "x", "cores": 2}
    kw: dict[str, Any] = {"root": tmp_path, "started": "2026-12-08T10:00:00+00:00", "machine": machine}
    first = results.record("scale_points", _summary(), details={"rows": []}, variant="edge", **kw)
    second = results.record("scale_points", _summary(), details={"rows": []}, variant="edge", **kw)
    commit = results.git_commit()
    assert first == tmp_path / "scale_points" / f"2026-12-08-{commit}-edge.json"
    assert second.name == f"2026-12-08-{commit}-edge-2.json"  # a second run the same day is kept too
    doc = json.loads(first.read_text())
    assert results.errors(doc) == []
    assert [f["name"] for f in doc["figures"]] == ["detection p95"]  # None and NaN left out, not written as 0
    assert doc["figures"][0]["where"] == {"nodes": 256}


def test_an_invalid_result_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    s = _summary()
    s.figure("detection p95", 2.0, "s", nodes=256)  # the same figure twice
    with pytest.raises(results.ResultError, match="appears twice"):
        results.record("x", s, root=tmp_path, started="2026-12-08", machine={"cpu": None, "cores": 2}, details={})
    with pytest.raises(results.ResultError, match="cores"):
        results.record("x", _summary(), root=tmp_path, started="2026-12-08", machine={"cpu": "x"}, details={})
    with pytest.raises(results.ResultError, match="started"):
        results.record(
            "x", _summary(), root=tmp_path, started="yesterday", machine={"cpu": "x", "cores": 1}, details={}
        )
    assert not any(tmp_path.iterdir())


def test_quick_runs_are_not_the_latest(tmp_path: Path) -> None:
    machine = {"cpu": "x", "cores": 2}
    full = results.record("catchup", Summary(parameters={"quick": False}), root=tmp_path, started="2026-12-07",
                          machine=machine, details={})  # fmt: skip
    results.record("catchup", Summary(parameters={"quick": True}), root=tmp_path, started="2026-12-08",
                   machine=machine, details={}, variant="smoke")  # fmt: skip
    stored = results.load(tmp_path)
    latest = results.latest(stored, "catchup")
    assert latest is not None and latest.path == full
    quick = results.latest(stored, "catchup", with_quick=True)
    assert quick is not None and quick.variant == "smoke"


def test_variant_from_a_report_prefix() -> None:
    assert results.variant_name("pipeline", "pipeline") is None
    assert results.variant_name("edge-5s", "pipeline") == "edge-5s"
    assert results.variant_name("My Run_2", "pipeline") == "my-run-2"
