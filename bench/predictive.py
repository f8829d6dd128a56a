"""The repeat-fault benchmark's predictive scenario (issue 44, deliverable 4): move a job off a GPU that is
about to fail at its next checkpoint, against the reactive path, on the simulated fleet of
sim/prefailure_fleet.py. A model in virtual time, not a run of the stack.

Per GPU fault:

- reactive: the job loses the work since its last checkpoint, the time to detect the fault, and one restart;
- migration, when a warning came lead_time_s before the fault and a checkpoint completes between the
  warning and the fault: the node is drained at the warning, the job is requeued at that checkpoint and
  loses no steps, only one restart; with no checkpoint in time it falls back to the reactive path.

Each false warning (precision below 1) drains a healthy node for drain_hold_h (node-hours for nothing)
and requeues the job running there at its next checkpoint (one needless restart). The sweep over lead
time and precision reports where migration stops paying. Every parameter says whether it is cited (with
the source and the phrase it comes from), an assumption, or a grid point.

bench/repeat_faults.py runs it as the scenario ``predictive`` (--scenarios predictive runs only this).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.prefailure_fleet import GPUS_PER_NODE, Fleet, FleetJob, FleetSpec, make_fleet
from sinks.prediction_audit import DETECTION_S

NAME = "predictive"
TITLE = "Predictive migration: act at the checkpoint before a GPU fails"

# --- sources --------------------------------------------------------------------------------------------------

LLAMA3 = {
    "url": "https://arxiv.org/abs/2407.21783",
    "where": "The Llama 3 Herd of Models (Meta, 2024), section 3.3.4, Table 5 (root causes of unexpected "
    "interruptions); the paper's body was not readable from here, the figures were read in its transcriptions "
    "by DatacenterDynamics and glennklockwood.com/garden/component-reliability, which agree",
    "says": "419 unexpected interruptions in a 54-day pre-training snapshot on 16,384 H100 GPUs; faulty GPU 148 "
    "(30.1 %), GPU HBM3 memory 72 (17.2 %)",
}
NVIDIA_CKPT = {
    "url": "https://developer.nvidia.com/blog/cut-checkpoint-costs-with-about-30-lines-of-python-and-nvidia-nvcomp/",
    "where": "NVIDIA Technical Blog, 'Cut Checkpoint Costs with About 30 Lines of Python and NVIDIA nvCOMP' "
    "(2026), section 'Inside a single checkpoint'",
    "says": "This is why most teams checkpoint every 15-30 minutes",
}
LIU = {
    "url": "https://arxiv.org/abs/2201.11853",
    "where": "Liu et al., 'Prediction of GPU Failures Under Deep Learning Workloads', arXiv 2201.11853v1, abstract "
    "(ByteDance production fleet, four months, 350 million entries)",
    "says": "our proposed techniques improve the prediction precision from 46.3% to 84.0%",
}
LIU_SYSTOR = {
    "url": "https://doi.org/10.1145/3579370.3594777",
    "where": "Liu et al., 'Predicting GPU Failures With High Precision Under Deep Learning Workloads', SYSTOR 2023, "
    "abstract (as listed by Mendeley)",
    "says": "our proposed techniques improve the prediction precision from 46.3% to 85.4% on production workloads",
}
MEASURED = {
    "url": "docs/benchmarks.md#repeat_faults",
    "where": "this benchmark's bad_node and no_progress scenarios (2026-12-03, commit 622cc8b): first detection",
    "says": "an Xid 79 found in 1.16 s, a silent dead rank in 31.88 s",
}

# Faulty GPU + GPU HBM3: the two classes a GPU-health verdict (ECC, row remap, PCIe, NVLink) can come before.
LLAMA3_GPU_FAULTS = 148 + 72
LLAMA3_GPU_HOURS = 16_384 * 54 * 24
LLAMA3_RATE = LLAMA3_GPU_FAULTS / LLAMA3_GPU_HOURS

# Precisions: the cited ones, then a grid around them. No lead time is published for any pre-failure signal
# that streams/catalog/prefailure.yaml reads (docs/prediction.md, 'Lead times'), so lead time is all grid.
CITED_PRECISIONS: tuple[tuple[float, str], ...] = (
    (0.463, "Liu et al. 2022: classic models (GBDT, MLP, LSTM, 1D-CNN)"),
    (0.84, "Liu et al. 2022: their model ensembles and sliding training"),
    (0.854, "Liu et al., SYSTOR 2023: the same, on production workloads"),
)
GRID_PRECISIONS = (0.1, 0.25, 0.5, 0.75, 0.95, 1.0)
GRID_LEAD_TIMES_S = (0.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 6 * 3600.0, 24 * 3600.0)


@dataclass(frozen=True)
class PredictiveConfig:
    jobs: int = 200
    nodes_choices: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    ckpt_interval_s: tuple[float, float] = (900.0, 1800.0)
    restart_s: float = 600.0
    detection_s: float = DETECTION_S  # the one figure goodput's saved-by-migration counts with
    fault_rate_per_gpu_h: float = LLAMA3_RATE
    horizon_h: float = 30 * 24.0
    recall: float = 0.5
    drain_hold_h: float = 2.0
    lead_times_s: tuple[float, ...] = GRID_LEAD_TIMES_S
    precisions: tuple[float, ...] = tuple(p for p, _ in CITED_PRECISIONS) + GRID_PRECISIONS
    seed: int = 11

    def spec(self) -> FleetSpec:
        return FleetSpec(
            jobs=self.jobs,
            nodes_choices=self.nodes_choices,
            ckpt_interval_s=self.ckpt_interval_s,
            restart_s=self.restart_s,
            fault_rate_per_gpu_h=self.fault_rate_per_gpu_h,
            horizon_s=self.horizon_h * 3600.0,
            recall=self.recall,
            seed=self.seed,
        )


def parameters(cfg: PredictiveConfig) -> dict[str, dict[str, Any]]:
    """Each model parameter with its basis: cited (source, where, the phrase), assumption (why), or grid."""
    cited_fault_rate = cfg.fault_rate_per_gpu_h == LLAMA3_RATE
    return {
        "fault_rate_per_gpu_h": {
            "value": cfg.fault_rate_per_gpu_h,
            "basis": "cited" if cited_fault_rate else "assumption",
            **(LLAMA3 if cited_fault_rate else {"why": "set on the command line"}),
            "derived": f"({LLAMA3_GPU_FAULTS} faulty-GPU and HBM3 interruptions) / (16,384 GPUs x 54 days x 24 h)",
        },
        "ckpt_interval_s": {
            "value": list(cfg.ckpt_interval_s),
            "basis": "cited" if cfg.ckpt_interval_s == (900.0, 1800.0) else "assumption",
            **NVIDIA_CKPT,
            "derived": "each job's interval drawn uniformly from 15 to 30 min",
        },
        "restart_s": {
            "value": cfg.restart_s,
            "basis": "assumption",
            "why": "requeue, start-up and checkpoint load of one restart; no source we found gives a typical figure "
            "for large jobs. NVIDIA's checkpoint post computes 156 s to write a 70B model's 782 GB at 5 GB/s, so "
            "loading it back alone takes minutes",
        },
        "detection_s": {
            "value": cfg.detection_s,
            "basis": "assumption",
            "why": "trainmedic's reactive path, from this benchmark's measured first detections",
            **MEASURED,
        },
        "recall": {
            "value": cfg.recall,
            "basis": "assumption",
            "why": "the share of GPU faults with a warning before them; no source publishes it for these signals. "
            "Benefit and false-warning cost both scale with the number of true warnings, so where migration "
            "stops paying does not depend on it; only the totals do",
        },
        "drain_hold_h": {
            "value": cfg.drain_hold_h,
            "basis": "assumption",
            "why": "how long a falsely warned node stays drained until its health check returns it",
        },
        "jobs": {"value": cfg.jobs, "basis": "assumption", "why": "fleet size; totals scale with it"},
        "nodes_choices": {
            "value": list(cfg.nodes_choices),
            "basis": "assumption",
            "why": "job sizes in nodes of 8 GPUs, one drawn uniformly per job",
        },
        "horizon_h": {"value": cfg.horizon_h, "basis": "assumption", "why": "a month of the fleet"},
        "lead_times_s": {
            "value": list(cfg.lead_times_s),
            "basis": "grid",
            "why": "no published lead time for any rule of streams/catalog/prefailure.yaml (docs/prediction.md)",
        },
        "precisions": {
            "value": list(cfg.precisions),
            "basis": "cited and grid",
            "cited": [{"value": p, "source": s} for p, s in CITED_PRECISIONS],
            "sources": [LIU, LIU_SYSTOR],
            "why": "the cited precisions are of a machine-learned GPU-failure predictor on a production fleet, "
            "not of these rules: they bound what a predictor has been shown to reach",
        },
    }


# --- accounting ---------------------------------------------------------------------------------------------------


@dataclass
class Losses:
    """GPU-seconds lost, by kind."""

    work: float = 0.0
    detection: float = 0.0
    restart: float = 0.0

    @property
    def total(self) -> float:
        return self.work + self.detection + self.restart

    def add(self, job: FleetJob, work_s: float, detection_s: float, restart_s: float) -> None:
        self.work += job.gpus * work_s
        self.detection += job.gpus * detection_s
        self.restart += job.gpus * restart_s


@dataclass
class Point:
    lead_time_s: float
    precision: float
    faults: int = 0
    warned: int = 0
    migrated: int = 0
    fell_back: int = 0
    false_warnings: int = 0
    reactive: Losses = field(default_factory=Losses)
    migration: Losses = field(default_factory=Losses)  # the faults' losses, warned or not
    warned_work_s: float = 0.0  # GPU-seconds of work lost on warned faults
    needless_requeue: float = 0.0  # GPU-seconds
    needless_drain_node_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        h = 3600.0
        migration = self.migration.total + self.needless_requeue
        saved = self.reactive.total - migration
        drains_gpu = GPUS_PER_NODE * self.needless_drain_node_s
        return {
            "lead_time_s": self.lead_time_s,
            "precision": self.precision,
            "faults": self.faults,
            "warned": self.warned,
            "migrated": self.migrated,
            "fell_back": self.fell_back,
            "false_warnings": self.false_warnings,
            "reactive_gpu_h": round(self.reactive.total / h, 3),
            "reactive_work_gpu_h": round(self.reactive.work / h, 3),
            "migration_gpu_h": round(migration / h, 3),
            "migration_work_gpu_h": round(self.migration.work / h, 3),
            "warned_work_gpu_h": round(self.warned_work_s / h, 3),
            "needless_requeue_gpu_h": round(self.needless_requeue / h, 3),
            "needless_drain_node_h": round(self.needless_drain_node_s / h, 3),
            "saved_gpu_h": round(saved / h, 3),
            "saved_with_drains_gpu_h": round((saved - drains_gpu) / h, 3),
            "pays": saved > 0,
            "pays_with_drains": saved - drains_gpu > 0,
        }


def false_warning_count(warned: int, precision: float) -> int:
    """False warnings that go with `warned` true ones at this precision (TP / (TP + FP) = precision)."""
    if not 0.0 < precision <= 1.0:
        raise ValueError(f"precision {precision} not in (0, 1]")
    return round(warned * (1.0 - precision) / precision)


def evaluate_point(fleet: Fleet, lead_time_s: float, precision: float, cfg: PredictiveConfig) -> Point:
    pt = Point(lead_time_s, precision)
    for fault in fleet.faults:
        job = fleet.job(fault.job_id)
        since_ckpt = fault.t_s - job.last_checkpoint(fault.t_s)
        pt.faults += 1
        pt.reactive.add(job, since_ckpt, cfg.detection_s, job.restart_s)
        if not fault.warned:
            pt.migration.add(job, since_ckpt, cfg.detection_s, job.restart_s)
            continue
        pt.warned += 1
        # The checkpoint must complete after the warning and before the fault; a lead time of 0 leaves none.
        if lead_time_s > 0 and job.next_checkpoint(fault.t_s - lead_time_s) < fault.t_s:
            pt.migrated += 1
            pt.migration.add(job, 0.0, 0.0, job.restart_s)
        else:
            pt.fell_back += 1
            pt.migration.add(job, since_ckpt, cfg.detection_s, job.restart_s)
            pt.warned_work_s += job.gpus * since_ckpt
    for fw in fleet.false_warnings(false_warning_count(pt.warned, precision)):
        job = fleet.job(fw.job_id)
        pt.false_warnings += 1
        pt.needless_requeue += job.gpus * job.restart_s
        pt.needless_drain_node_s += cfg.drain_hold_h * 3600.0
    return pt


def break_even(fleet: Fleet, lead_time_s: float, cfg: PredictiveConfig) -> dict[str, Any]:
    """The precision above which migration pays at this lead time: a true warning saves `gain` GPU-seconds on
    average, a false one costs `cost`, so migration pays when P / (1 - P) > cost / gain, P* = cost / (cost + gain).
    Exact in expectation; the grid points above are its check."""
    perfect = evaluate_point(fleet, lead_time_s, 1.0, cfg)
    gain = (perfect.reactive.total - perfect.migration.total) / perfect.warned if perfect.warned else 0.0
    sample = fleet.false_warnings(2000)
    cost = sum(fleet.job(f.job_id).gpus * fleet.job(f.job_id).restart_s for f in sample) / len(sample)
    drain = GPUS_PER_NODE * cfg.drain_hold_h * 3600.0

    def p_star(c: float) -> float | None:
        return round(c / (c + gain), 3) if gain > 0 else None

    return {
        "lead_time_s": lead_time_s,
        "gain_per_true_warning_gpu_h": round(gain / 3600.0, 3),
        "cost_per_false_warning_gpu_h": round(cost / 3600.0, 3),
        "drain_per_false_warning_node_h": cfg.drain_hold_h,
        "break_even_precision": p_star(cost),
        "break_even_precision_with_drains": p_star(cost + drain),
    }


def run(cfg: PredictiveConfig) -> dict[str, Any]:
    """The scenario's evaluation, in the shape bench/repeat_faults.py keeps per scenario (with `checks`)."""
    fleet = make_fleet(cfg.spec())
    points = [evaluate_point(fleet, lt, p, cfg).as_dict() for lt in cfg.lead_times_s for p in cfg.precisions]
    gpus = sum(j.gpus for j in fleet.jobs)
    ev: dict[str, Any] = {
        "scenario": NAME,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
        "parameters": parameters(cfg),
        "fleet": {
            "jobs": len(fleet.jobs),
            "gpus": gpus,
            "gpu_hours": round(gpus * cfg.horizon_h, 1),
            "faults": len(fleet.faults),
            "warned_faults": sum(1 for f in fleet.faults if f.warned),
        },
        "points": points,
        "break_even": [break_even(fleet, lt, cfg) for lt in cfg.lead_times_s],
    }
    ev["checks"] = checks(fleet, cfg)
    return ev


def checks(fleet: Fleet, cfg: PredictiveConfig) -> dict[str, bool]:
    """Two facts the model must hold on this fleet, run whatever the sweep: with no lead time migration is
    the reactive path; with a lead time of at least the longest checkpoint interval and no false warning,
    no warned fault loses work."""
    zero = evaluate_point(fleet, 0.0, 1.0, cfg)
    ahead = evaluate_point(fleet, max(cfg.ckpt_interval_s), 1.0, cfg)
    return {
        "no_lead_time_equals_reactive": abs(zero.migration.total - zero.reactive.total) < 1e-6
        and zero.false_warnings == 0,
        "lead_time_over_interval_loses_no_work": ahead.warned_work_s == 0.0 and ahead.migrated == ahead.warned,
    }


# --- report -------------------------------------------------------------------------------------------------------


def _row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _dur(s: float) -> str:
    if s == 0:
        return "0"
    if s < 3600:
        return f"{s / 60:g} min"
    return f"{s / 3600:g} h"


def _precision_label(p: float) -> str:
    cited = {c: s for c, s in CITED_PRECISIONS}
    return f"{p:g} (cited)" if p in cited else f"{p:g} (grid)"


def side_by_side(ev: dict[str, Any]) -> list[str]:
    """Reactive and migration beside each other, at the cited precisions, for every lead time (all grid)."""
    cited = {p for p, _ in CITED_PRECISIONS}
    lines = [
        _row(
            [
                "lead time (grid)",
                "precision",
                "reactive GPU-h",
                "with migration GPU-h",
                "of which needless requeues",
                "needless drains node-h",
                "saved GPU-h",
                "saved, drains counted",
            ]
        ),
        _row(["---"] * 2 + ["---:"] * 6),
    ]
    for pt in ev["points"]:
        if pt["precision"] not in cited:
            continue
        lines.append(
            _row(
                [
                    _dur(pt["lead_time_s"]),
                    _precision_label(pt["precision"]),
                    pt["reactive_gpu_h"],
                    pt["migration_gpu_h"],
                    pt["needless_requeue_gpu_h"],
                    pt["needless_drain_node_h"],
                    pt["saved_gpu_h"],
                    pt["saved_with_drains_gpu_h"],
                ]
            )
        )
    return lines


def sweep_grid(ev: dict[str, Any], key: str) -> list[str]:
    """GPU-hours saved (negative: lost) for every lead time and precision."""
    precisions = sorted({pt["precision"] for pt in ev["points"]})
    by = {(pt["lead_time_s"], pt["precision"]): pt for pt in ev["points"]}
    leads = sorted({pt["lead_time_s"] for pt in ev["points"]})
    lines = [
        _row(["lead time \\ precision", *(_precision_label(p) for p in precisions)]),
        _row(["---", *(["---:"] * len(precisions))]),
    ]
    for lt in leads:
        lines.append(_row([_dur(lt), *(f"{by[(lt, p)][key]:g}" for p in precisions)]))
    return lines


def break_even_table(ev: dict[str, Any]) -> list[str]:
    lines = [_row(["lead time", "break-even precision", "with drains counted"]), _row(["---", "---:", "---:"])]
    for be in ev["break_even"]:
        lines.append(
            _row(
                [
                    _dur(be["lead_time_s"]),
                    be["break_even_precision"] if be["break_even_precision"] is not None else "never",
                    be["break_even_precision_with_drains"]
                    if be["break_even_precision_with_drains"] is not None
                    else "never",
                ]
            )
        )
    return lines


def table(ev: dict[str, Any]) -> list[str]:
    """The console summary (what bench/repeat_faults.py prints per scenario)."""
    return [*side_by_side(ev), "", *break_even_table(ev)]


def report(ev: dict[str, Any], title: str = TITLE) -> list[str]:
    """The scenario's section of bench/results/repeat-faults.md."""
    f, c = ev["fleet"], ev["config"]
    params = ev["parameters"]
    lines = [
        f"## {title}",
        "",
        "A model in virtual time on the simulated fleet of `sim/prefailure_fleet.py`, not a run of the stack: "
        f"{f['jobs']} job slots ({f['gpus']:,} GPUs, {f['gpu_hours']:,} GPU-hours over {c['horizon_h']:g} h), "
        f"{f['faults']} GPU faults, {f['warned_faults']} of them warned (recall {c['recall']:g}). Reactive: the work "
        f"since the last checkpoint + detection ({c['detection_s']:g} s) + one restart ({c['restart_s']:g} s). "
        "Migration: drain at the warning, requeue at the next checkpoint if it completes before the fault (no "
        "steps lost, one restart), else reactive. A false warning drains a healthy node for "
        f"{c['drain_hold_h']:g} h and requeues its job once for nothing.",
        "",
        "Side by side at the cited precisions. **No lead time is published** for any signal the pre-failure "
        "catalog reads (docs/prediction.md), so every lead time here is a grid point:",
        "",
        *side_by_side(ev),
        "",
        "Where migration stops paying: the break-even precision at each lead time (a true warning saves the work "
        "since the last checkpoint and the detection time when a checkpoint falls in the lead time; a false one "
        "costs a restart, and with drains counted also 8 GPUs x the drain hold):",
        "",
        *break_even_table(ev),
        "",
        "GPU-hours saved over the whole grid (negative: migration loses more than it saves), drains not counted:",
        "",
        *sweep_grid(ev, "saved_gpu_h"),
        "",
        "The same with the needless drains counted as 8 GPU-hours per node-hour (a full fleet, no spare nodes):",
        "",
        *sweep_grid(ev, "saved_with_drains_gpu_h"),
        "",
        "Parameters and their basis:",
        "",
    ]
    for name, p in params.items():
        src = p.get("url")
        basis = p["basis"]
        text = f"- `{name}` = {p['value']}: {basis}"
        if basis.startswith("cited") and src:
            text += f' ([source]({src}); {p["where"]}: "{p["says"]}")'
        if p.get("derived"):
            text += f"; {p['derived']}"
        if p.get("why"):
            text += f". {p['why']}"
        if p.get("cited"):
            text += ". Cited precisions: " + "; ".join(f"{x['value']:g}: {x['source']}" for x in p["cited"])
            text += ". Sources: " + "; ".join(
                f'[{s["where"].split(",")[0]}]({s["url"]}) "{s["says"]}"' for s in p["sources"]
            )
        lines.append(text + ".")
    failed = [k for k, v in ev["checks"].items() if not v]
    lines += ["", "Checks: " + ("all passed" if not failed else "FAILED: " + ", ".join(failed)) + ".", ""]
    return lines
