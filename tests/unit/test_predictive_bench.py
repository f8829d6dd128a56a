"""The repeat-fault benchmark's predictive scenario (bench/predictive.py on sim/prefailure_fleet.py): the
plumbing on the smallest input, and what migration must and must not save."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench import predictive, repeat_faults, results
from sim.prefailure_fleet import FalseWarning, Fault, Fleet, FleetJob, make_fleet


def _one_job_fleet(fault_t: float, warned: bool = True) -> tuple[Fleet, predictive.PredictiveConfig]:
    """One 2-node job checkpointing at 0, 1000, 2000 s ..., one fault at fault_t."""
    cfg = predictive.PredictiveConfig(jobs=1, recall=1.0, detection_s=30.0, restart_s=600.0, drain_hold_h=2.0)
    job = FleetJob(job_id=0, nodes=2, ckpt_interval_s=1000.0, ckpt_offset_s=0.0, restart_s=600.0)
    return Fleet(cfg.spec(), (job,), (Fault(0, 1, fault_t, warned),)), cfg


def test_smallest_run_writes_a_valid_result(tmp_path: Path) -> None:
    rc = repeat_faults.main(
        [
            "--scenarios",
            "predictive",
            "--predictive-jobs",
            "3",
            "--lead-times",
            "3600",
            "--precisions",
            "0.84",
            "--out",
            str(tmp_path),
            "--data-dir",
            str(tmp_path / "data"),
        ]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "repeat-faults.json").read_text())
    ev = doc["scenarios"]["predictive"]
    assert [(p["lead_time_s"], p["precision"]) for p in ev["points"]] == [(3600.0, 0.84)]
    assert ev["fleet"]["jobs"] == 3
    stored = results.load(tmp_path)
    assert len(stored) == 1 and stored[0].benchmark == "repeat_faults"
    assert results.errors(stored[0].doc) == []
    names = {(f["name"], f["where"].get("world")) for f in stored[0].doc["figures"]}
    assert ("GPU-hours lost", "reactive") in names and ("GPU-hours lost", "migration") in names
    verdicts = {v["name"]: v["passed"] for v in stored[0].doc["verdicts"]}
    assert verdicts == {"no lead time equals reactive": True, "lead time over interval loses no work": True}
    assert "## 4. Predictive migration" in (tmp_path / "repeat-faults.md").read_text()


def test_migration_needs_a_checkpoint_between_warning_and_fault() -> None:
    fleet, cfg = _one_job_fleet(1500.0)  # last checkpoint at 1000: the reactive path loses 500 s of work
    reactive = 16 * (500.0 + 30.0 + 600.0)
    late = predictive.evaluate_point(fleet, 400.0, 1.0, cfg)  # warned at 1100, next checkpoint 2000: too late
    assert (late.migrated, late.fell_back) == (0, 1)
    assert late.reactive.total == late.migration.total == reactive
    early = predictive.evaluate_point(fleet, 600.0, 1.0, cfg)  # warned at 900, checkpoint at 1000 in time
    assert (early.migrated, early.fell_back) == (1, 0)
    assert early.migration.work == 0.0 and early.migration.total == 16 * 600.0


def test_an_unwarned_fault_and_no_lead_time_are_the_reactive_path() -> None:
    fleet, cfg = _one_job_fleet(1500.0, warned=False)
    pt = predictive.evaluate_point(fleet, 3600.0, 1.0, cfg)
    assert pt.warned == 0 and pt.migration.total == pt.reactive.total
    full = make_fleet(dataclasses.replace(cfg, jobs=50, recall=1.0).spec())
    zero = predictive.evaluate_point(full, 0.0, 1.0, cfg)
    assert zero.faults > 0 and zero.migration.total == zero.reactive.total


def test_lead_time_over_the_interval_loses_no_steps() -> None:
    cfg = predictive.PredictiveConfig(jobs=50, recall=1.0)
    fleet = make_fleet(cfg.spec())
    pt = predictive.evaluate_point(fleet, max(cfg.ckpt_interval_s), 1.0, cfg)
    assert pt.faults > 0 and pt.migrated == pt.faults
    assert pt.migration.work == 0.0 and pt.migration.detection == 0.0
    assert pt.reactive.total > pt.migration.total


def test_false_warnings_cost_a_requeue_and_a_drain_each() -> None:
    fleet, cfg = _one_job_fleet(1500.0)
    pt = predictive.evaluate_point(fleet, 600.0, 0.25, cfg)  # 1 true warning at precision 1/4: 3 false ones
    assert pt.false_warnings == 3
    assert pt.needless_requeue == 3 * 16 * 600.0
    assert pt.needless_drain_node_s == 3 * 2.0 * 3600.0
    assert fleet.false_warnings(3)[:2] == fleet.false_warnings(2)  # the same sequence at every sweep point
    assert all(isinstance(f, FalseWarning) and f.job_id == 0 for f in fleet.false_warnings(3))


def test_break_even_precision_separates_paying_from_losing() -> None:
    cfg = predictive.PredictiveConfig()
    fleet = make_fleet(cfg.spec())
    be = predictive.break_even(fleet, 3600.0, cfg)
    p = be["break_even_precision"]
    assert p is not None and 0.0 < p < 1.0
    above = predictive.evaluate_point(fleet, 3600.0, min(1.0, p + 0.05), cfg).as_dict()
    below = predictive.evaluate_point(fleet, 3600.0, p - 0.05, cfg).as_dict()
    assert above["pays"] and not below["pays"]
    assert predictive.break_even(fleet, 0.0, cfg)["break_even_precision"] is None  # nothing to gain
