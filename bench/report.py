"""Markdown report and matplotlib plots for bench/pipeline.py's JSON."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

NVIDIA_DETECTION_S = 69.0
NVIDIA_ACTION_S = 94.0

# Profile frames that point at a known cost, and what to do about it (streams/ is not this
# benchmark's to change: these are recommendations).
PROFILE_HINTS: tuple[tuple[str, str], ...] = (
    (
        "straggler.py",
        "StragglerDetector.check recomputes window medians of SM clock, power and utilization for every GPU of "
        "every job from scratch every 2 s (O(GPUs x window samples)). Keep per-GPU running medians "
        "(or per-10 s pre-aggregated buckets) updated in observe_gpu, and check each job every 10-30 s "
        "(its window is 120 s), not every 2 s.",
    ),
    (
        "pydantic",
        "Decoding every GpuSample into pydantic models (8 GpuMetrics each) costs more than the detectors: "
        "decode GPU samples with orjson into plain dicts (or a msgspec Struct) in detect_gpu and keep only "
        "the fields the hang/straggler detectors read.",
    ),
    (
        "faust",
        "Faust's per-event machinery (Stream.__aiter__, acking, Event objects) is paid once per record: "
        "consume GPU samples in batches (stream.take(500, within=0.2)) or publish one record per node group "
        "per interval.",
    ),
    (
        "aiokafka",
        "aiokafka's fetch/parse path is pure Python per record: larger fetch batches, or fewer, larger records "
        "(several nodes per GpuSample batch), cut its per-record cost.",
    ),
    (
        "hang.py",
        "HangDetector.observe_gpu is called per sample; its cost is small, but check() walks every job every 2 s.",
    ),
    (
        "statistics.py",
        "statistics.median on Python lists (sorting per call) dominates inside the straggler check: numpy or a "
        "running-median structure would cut it by an order of magnitude.",
    ),
)


def _f(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}{unit}"
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    if s < 10:
        return f"{s:.2f} s"
    return f"{s:.1f} s"


def _dist(d: dict[str, Any] | None, fmt: Any = _dur) -> str:
    if not d or not d.get("n"):
        return "-"
    if d["n"] == 1:
        return fmt(d["p50"])
    return f"{fmt(d['p50'])} / {fmt(d['p95'])} / {fmt(d['max'])}"


def _d(xs: list[float]) -> dict[str, Any]:
    """p50 / p95 / max of a list, as bench.pipeline.dist gives them."""
    from bench.pipeline import dist

    return dist(xs)


def _row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# --- plots --------------------------------------------------------------------------------------------


def _cdf(ax: Any, values: list[float], label: str, **kw: Any) -> None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})", **kw)


def plots(doc: dict[str, Any], out: Path, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []
    main = doc.get("main") or {}
    outcomes = [o for o in main.get("outcomes", []) if o.get("detected")]
    if outcomes:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
        groups = {
            "explicit faults": [o for o in outcomes if o["kind"] not in ("hang", "straggler")],
            "hang": [o for o in outcomes if o["kind"] == "hang"],
            "straggler": [o for o in outcomes if o["kind"] == "straggler"],
        }
        ax = axes[0]
        for name, os_ in groups.items():
            _cdf(ax, [o["detection_s"] for o in os_], f"trainmedic: {name}")
        _cdf(
            ax, [o["baseline"]["detect_s"] + 0.5 for o in outcomes if "baseline" in o], "status quo", ls="--", c="grey"
        )
        ax.axvline(NVIDIA_DETECTION_S, c="red", ls=":", label="NVIDIA mean 69 s")
        ax.set_xscale("log")
        ax.set_xlabel("detection latency, s (first fault signal -> incident; status quo: +0.5 s for log scale)")
        ax.set_ylabel("fraction of faults")
        ax.set_title("Detection")
        ax.legend(fontsize=7)
        ax = axes[1]
        _cdf(ax, [o.get("action_latency_s") for o in outcomes if o.get("action_latency_s") is not None], "trainmedic")
        ax.axvline(NVIDIA_ACTION_S, c="red", ls=":", label="NVIDIA mean 94 s")
        ax.set_xscale("log")
        ax.set_xlabel("action latency, s (incident -> effect verified)")
        ax.set_title("Action")
        ax.legend(fontsize=7)
        ax = axes[2]
        rec = [o for o in outcomes if o["expected_action"] in ("drain_and_requeue", "requeue")]
        _cdf(ax, [o.get("running_again_s") for o in rec if o.get("running_again_s") is not None], "trainmedic")
        _cdf(
            ax,
            [o["baseline"].get("running_again_expected_s") for o in rec if "baseline" in o],
            "status quo (expected, incl. re-landing)",
            ls="--",
            c="grey",
        )
        ax.set_xscale("log")
        ax.set_xlabel("fault -> job RUNNING again, s")
        ax.set_title("Recovery (requeue faults)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{prefix}_latency_cdf.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    series_sets: list[tuple[str, dict[str, list[list[float]]]]] = []
    if main.get("lag"):
        series_sets.append((f"main ({main['cluster']['nodes']} nodes)", main["lag"]["series"]))
    for row in (doc.get("scale") or {}).get("rows", []):
        series_sets.append((f"{row['nodes']} nodes", row["lag_series"]))
    if series_sets:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), sharey=True)
        for ax, agent in zip(axes, ("detect_gpu", "detect_logs", "detect_kernel"), strict=True):
            for label, series in series_sets:
                pts = series.get(agent) or []
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, lw=1)
            ax.axhline(2.0, c="red", ls=":", lw=1, label="2 s bound")
            ax.set_yscale("log")
            ax.set_title(f"consumer lag: {agent}")
            ax.set_xlabel("seconds since the cluster started")
        axes[0].set_ylabel("probe lag, s (max per second)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        name = f"{prefix}_lag.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    rows = (doc.get("scale") or {}).get("rows", [])
    if rows:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        ns = [r["nodes"] for r in rows]
        axes[0].plot(ns, [r["lag_max_s"] or 0 for r in rows], "o-", label="max probe lag")
        axes[0].plot(ns, [r["detection_s"]["p95"] or 0 for r in rows], "s-", label="detection p95")
        axes[0].axhline(2.0, c="red", ls=":", lw=1)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("s")
        axes[0].legend(fontsize=8)
        for comp in ("worker", "broker", "main"):
            axes[1].plot(ns, [r["resources"]["cpu_pct"].get(comp) or 0 for r in rows], "o-", label=comp)
        axes[1].plot(
            ns, [r["resources"].get("machine_busy_pct") or 0 for r in rows], "k--", label="machine (of 2 cores)"
        )
        axes[1].set_ylabel("CPU % of one core")
        axes[1].legend(fontsize=8)
        axes[2].plot(ns, [r["input_events_per_s"] for r in rows], "o-", label="input events/s")
        axes[2].plot(ns, [r["log_lines_per_s"] for r in rows], "s-", label="log lines/s")
        axes[2].legend(fontsize=8)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("nodes (x 8 GPUs)")
        fig.tight_layout()
        name = f"{prefix}_scale.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


# --- markdown -----------------------------------------------------------------------------------------


def render(doc: dict[str, Any], out: Path, prefix: str = "pipeline") -> Path:
    images = plots(doc, out, prefix)
    md: list[str] = []
    m = doc["machine"]
    main = doc.get("main")
    md.append("# Pipeline benchmark: trainmedic against a simulated GPU cluster\n")
    md.append(
        f"Measured {doc['measured_at']} on {m['cores']} cores ({m['cpu']}), {m.get('mem_gb')} GB, Python {m['python']}, "
        f"with `{doc['command'].strip()}`. One run of each scenario, not an average: figures move by a few "
        "tenths of a second between runs.\n"
    )
    md.append(
        "The real stack (embedded Tansu broker, Faust streams worker subprocess, executor and chDB audit sink "
        "threads) runs against `sim.cluster`: N nodes x 8 GPUs, one GpuSample per node per second, "
        "Megatron-style progress lines at each job's step rate, kernel lines, scheduler events, "
        "and the simulated Slurm that the executor drains and requeues on. Faults from `sim.faults` "
        "use the real texts of tests/fixtures. Latencies come from the audit trail "
        "(incident and action result times) and the simulated scheduler's own record.\n"
    )
    if doc.get("gpu_summary_every_s"):
        every = doc["gpu_summary_every_s"]
        md.append(
            f"**Edge aggregation on** (`produce gpu --summary-every {every:g}`): every node's GPUs are still read "
            f"each second, but `producers.gpu_edge.EdgeSummary` publishes the latest reading every {every:g} s, "
            "and at once any reading whose GPU health changed or that carries an Xid.\n"
        )
    if main:
        md += _main_section(main, doc)
    scale = doc.get("scale")
    if scale and scale.get("rows"):
        md += _scale_section(scale)
    if doc.get("profile"):
        md += _profile_section(doc["profile"])
    if doc.get("payload_microbench"):
        md += _payload_section(doc["payload_microbench"])
    if main:
        md += _gaps_section(main)
    for img in images:
        md.append(f"![{img}]({img})\n")
    path = out / f"{prefix}.md"
    path.write_text("\n".join(md))
    return path


def _main_section(ev: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    c = ev["cluster"]
    ov = ev["overall"]
    a = ev["assumptions"]
    relanded = sorted(
        {
            f"`{o['kind']}`"
            for o in ev["outcomes"]
            if o.get("relanded_on_culprit") and o.get("decision_kind") == "action"
        }
    )
    detected = [o for o in ev["outcomes"] if o.get("detected")]
    explicit = [o for o in detected if o["kind"] not in ("hang", "straggler", "nccl_dead_rank")]
    silent = [o for o in detected if o not in explicit]
    md = [
        f"## Faults: {c['nodes']} nodes x 8 GPUs ({c['gpus']} GPUs), {c['jobs']} jobs, transport `{c['transport']}`\n",
        f"Seed {c['seed']}; {ov['injected']} faults injected ({ov['skipped']} skipped), one per job, into running "
        f"jobs; the other jobs are the healthy control. Half the jobs print progress on every node "
        f"(torchtitan-like), the others on their last rank only (Megatron). "
        + (
            f"NCCL's watchdog is compressed to {c['nccl_timeout_s']:.0f} s in the simulator (as in "
            "`trainmedic demo`), so the timeout cascade of the other ranks arrives while trainmedic acts; "
            "the status quo columns use the real 600 s. "
            if c["nccl_timeout_s"] < 600
            else "NCCL's watchdog keeps its real 600 s in the simulator: trainmedic acts long before the waiting "
            "ranks' timeout lines would appear. "
        )
        + f"Requeued jobs wait {c['requeue_delay_s']:.0f} s before they run again (Slurm's cred_expire, shortened). "
        f"Duration {ev['duration_s']:.0f} s after a stack start of {ev['startup_s']:.0f} s. For a hang and a "
        "straggler the first fault signal is the moment the job stops or the node starts throttling.\n",
        "### Headline\n",
        "| figure | trainmedic (p50 / p95 / max) | status quo (same faults) | NVIDIA's published mean |",
        "|---|---|---|---|",
        _row(
            [
                "detection latency (first fault signal written -> incident published)",
                _dist(ov["detection_s"]),
                _dist(ov["baseline"]["detect_s"]),
                "69 s",
            ]
        ),
        _row(
            [
                "  of which faults with an explicit signal (Xid, log line, srun)",
                _dist(_d([o["detection_s"] for o in explicit])),
                _dist(_d([o["baseline"]["detect_s"] for o in explicit if "baseline" in o])),
                "",
            ]
        ),
        _row(
            [
                "  of which faults found by their effect (hang, straggler, dead rank)",
                _dist(_d([o["detection_s"] for o in silent])),
                _dist(_d([o["baseline"]["detect_s"] for o in silent if "baseline" in o])),
                "",
            ]
        ),
        _row(["action latency (incident -> effect verified)", _dist(ov["action_s"]), "manual", "94 s"]),
        _row(
            [
                "fault -> job RUNNING again (requeue faults)",
                _dist(ov["running_again_s"]),
                _dist(ov["baseline"]["running_again_expected_s"]),
                "-",
            ]
        ),
        _row(["fault -> job stopped (stop faults, acted on)", _dist(ov["stopped_s"]), "at the crash, or noticed", "-"]),
        _row(
            [
                "GPU hours lost per fault",
                _dist(ov["gpu_h_per_fault"], lambda v: _f(v, "", 2)),
                _dist(ov["baseline"]["gpu_h_per_fault"], lambda v: _f(v, "", 2)),
                "-",
            ]
        ),
        _row(
            [
                "category / culprit / action accuracy",
                f"{_pct(ov['category_accuracy'])} / {_pct(ov['culprit_accuracy'])} / {_pct(ov['action_accuracy'])}",
                "none (a person diagnoses)",
                "-",
            ]
        ),
        _row(
            [
                "bad node isolated before the restart",
                f"{ov['executed']} actions; {ov['relanded_on_culprit']} restarts landed on the faulty node again "
                f"({', '.join(relanded) or 'none'})",
                f"never; a plain requeue re-lands with p = {_dist(ov['baseline']['p_reland_random'], lambda v: _f(v, '', 2))} "
                f"(uniform placement), {ov['baseline']['first_fit_relands']} of {ov['injected']} would re-land first-fit",
                "-",
            ]
        ),
        _row(
            [
                "false incidents / actions on healthy jobs / innocent drains",
                f"{len(ev['false_incidents'])} / {len(ev['actions_on_healthy_jobs'])} / {len(ev['innocent_drains'])}",
                "-",
                "-",
            ]
        ),
        "",
        "### Per fault kind, with the status quo beside each figure\n",
        "Latencies are p50 / p95 / max over the injections of that kind (one value when n = 1). "
        "trainmedic's end-to-end column is fault -> RUNNING again for requeue faults, fault -> stopped "
        "for stop faults. The status quo: detection when NCCL's watchdog fires (600 s), at the crash for "
        "faults that crash the process, or when a person notices a fault that fails nothing "
        f"({_dur(a['silent_notice_s'])}); then {_dur(a['manual_response_s'])} of manual response before a "
        "requeue; the expected value divides by (1 - p) for persistent hardware faults, p being the chance "
        "that a plain requeue lands on the bad node again (uniform placement over the free nodes and the "
        "job's own). GPU hours lost count the job's GPUs from the fault until it runs again or is stopped "
        "(a straggler's GPUs count by its slowdown); lost progress since the last checkpoint is the same on "
        "both sides and is left out.\n",
        "| fault | n | detected | category | culprit | action | detection: trainmedic | detection: status quo "
        "| action latency | end to end: trainmedic | end to end: status quo (expected) | GPU h/fault: trainmedic "
        "| GPU h/fault: status quo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    from sim.faults import FAULTS

    for kind, k in ev["by_kind"].items():
        spec = FAULTS[kind]
        first = next(o for o in ev["outcomes"] if o["kind"] == kind)
        want_cat, want_action = first["expected_category"], first["expected_action"]
        recover = want_action in ("drain_and_requeue", "requeue")
        e2e = k["running_again_s"] if recover else k["stopped_s"]
        b = k["baseline"]
        b_e2e = _dist(b["running_again_expected_s"]) if recover else f"stopped at {_dist(b['detect_s'])}"
        culprit = _pct(k["culprit_accuracy"]) if spec.culprit_scored else "n/a"
        if spec.culprit_scored and k.get("culprit_in_explanation") and not k["culprit_accuracy"]:
            culprit += f" (named in the explanation: {_pct(k['culprit_in_explanation'])})"
        action = _pct(k["action_accuracy"])
        if k["recommended_only"]:
            action += f" ({k['recommended_only']} recommended only)"
        md.append(
            _row(
                [
                    f"{spec.title} (`{kind}` -> {want_cat}, {want_action})",
                    k["injected"],
                    k["detected"],
                    _pct(k["category_accuracy"]),
                    culprit,
                    action,
                    _dist(k["detection_s"]),
                    f"{_dist(b['detect_s'])} ({spec.baseline})",
                    _dist(k["action_s"]),
                    _dist(e2e),
                    b_e2e,
                    _dist(k["gpu_h_per_fault"], lambda v: _f(v, "", 2)),
                    _dist(b["gpu_h_per_fault"], lambda v: _f(v, "", 2)),
                ]
            )
        )
    md.append("")
    misses = [o for o in ev["outcomes"] if o.get("detected") is False or o.get("category_ok") is False]
    wrong = [
        o for o in ev["outcomes"] if o.get("detected") and (not o.get("action_ok") or o.get("culprit_ok") is False)
    ]
    if misses or wrong:
        md.append("Injections that were missed, misclassified, or not acted on as expected:\n")
        md.append("| fault | job | node | detected | category | culprit | decision | action | results |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for o in misses + [w for w in wrong if w not in misses]:
            md.append(
                _row(
                    [
                        o["kind"],
                        o["job_id"],
                        o["node"],
                        o.get("detected"),
                        f"{o.get('category')} (want {o['expected_category']})",
                        f"{o.get('culprit')} (want {o['expected_culprit']})",
                        o.get("decision_kind"),
                        f"{o.get('action')} (want {o['expected_action']})",
                        ",".join(o.get("result_status") or []) or "-",
                    ]
                )
            )
        md.append("")
    md.append(
        f"Healthy jobs: {len(ev['false_incidents'])} incidents no injection explains"
        f"{_short(ev['false_incidents'])}; {len(ev['actions_on_healthy_jobs'])} actions on jobs without a fault; "
        f"{len(ev['innocent_drains'])} drains of a node that was not a culprit.\n"
    )
    t = ev["throughput"]
    r = ev["resources"]
    lag = ev["lag"]
    md += [
        "### Load, lag and resources during this scenario\n",
        f"Input: {_f(t['input_events_per_s'])} events/s ({', '.join(f'{k} {_f(v)}' for k, v in t['by_topic_per_s'].items())}), "
        f"{_f(t['log_lines_per_s'])} log lines/s, {_f(t['gpus_reported_per_s'])} GPU readings/s. "
        f"Consumer lag (probe p50 / p95 / max): "
        + "; ".join(f"{agent} {_dist(d, lambda v: _f(v, ' s', 2))}" for agent, d in lag["agents"].items())
        + f". Catch-up after the cluster stopped: {_f(ev['drain_s'], ' s', 2)}. Signal -> anomaly "
        f"(log and kernel detectors): {_dist(ev['anomaly_lag_s'], lambda v: _f(v, ' s', 2))}.\n",
        _resources_table(r),
    ]
    return md


def _short(items: list[dict[str, Any]]) -> str:
    if not items:
        return ""
    return " (" + "; ".join(f"job {i.get('job_id')}: {i.get('category')}" for i in items[:5]) + ")"


def _resources_table(r: dict[str, Any]) -> str:
    lines = [
        f"CPU over {r.get('window_s')} s in steady state (% of one core; the machine has 2), peak RSS:\n",
        "| component | CPU % | peak RSS MB |",
        "|---|---|---|",
    ]
    names = {
        "worker": "streams worker (Faust subprocess)",
        "broker": "broker (Tansu)",
        "main": "main process (simulator + executor + audit sink + chDB)",
    }
    for k in ("worker", "broker", "main"):
        lines.append(_row([names[k], _f(r["cpu_pct"].get(k)), _f(r["rss_mb_peak"].get(k))]))
    for k, v in sorted(r["cpu_pct"].items()):
        if k.startswith("main/"):
            lines.append(_row([f"  of which {k[5:]}", _f(v), ""]))
    lines.append(_row(["whole machine (busy, % of 2 cores x 100)", _f(r.get("machine_busy_pct")), ""]))
    return "\n".join(lines) + "\n"


def _scale_section(scale: dict[str, Any]) -> list[str]:
    md = [
        "## Scale: the largest cluster this 2-core machine sustains\n",
        f"Each size runs {scale['seconds']:.0f} s (plus the time its faults need) on a fresh stack, with jobs that "
        "were already running (their RUNNING events dated 300 s back, so the hang and straggler detectors are "
        "past their warm-up), every node sending 8 GPUs at 1 Hz and every node of every job printing its "
        "progress, and six explicit faults (Xid 79, Xid 48, CUDA OOM, IB flap, storage full, node failure). "
        f"Sustained: every probe answered within {2.0:.0f} s, catch-up after the stop within 3 s, all faults "
        "detected, detection p95 within max(1.5x, +1 s) of the smallest size's, and the simulator on time. "
        "The search stops at the first size that fails. GPUs per central core: GPUs / (streams workers + broker + "
        "audit sink + executor CPU, in cores).\n",
        f"**Largest sustained: {scale.get('largest_sustained_nodes')} nodes "
        f"({(scale.get('largest_sustained_nodes') or 0) * 8} GPUs)**"
        + (f"; {scale['first_failing_nodes']} nodes fail." if scale.get("first_failing_nodes") else ".")
        + "\n",
        "| nodes | GPUs | jobs | events/s | log lines/s | lag signals p95 / max | lag logs p95 / max | lag kernel max "
        "| catch-up | detection p50 / p95 | action p50 | worker CPU % | broker CPU % | main CPU % | machine busy % "
        "| GPUs per central core | worker RSS MB | sustained |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in scale["rows"]:
        lag = r["lag"]
        res = r["resources"]
        md.append(
            _row(
                [
                    r["nodes"],
                    r["gpus"],
                    r["jobs"],
                    _f(r["input_events_per_s"]),
                    _f(r["log_lines_per_s"]),
                    f"{_f(lag['detect_gpu']['p95'], '', 2)} / {_f(lag['detect_gpu']['max'], '', 2)}",
                    f"{_f(lag['detect_logs']['p95'], '', 2)} / {_f(lag['detect_logs']['max'], '', 2)}",
                    _f(lag["detect_kernel"]["max"], "", 2),
                    _f(r["drain_s"], " s", 1),
                    f"{_f(r['detection_s']['p50'], '', 2)} / {_f(r['detection_s']['p95'], '', 2)}",
                    _f(r["action_s"]["p50"], "", 2),
                    _f(res["cpu_pct"].get("workers", res["cpu_pct"].get("worker"))),
                    _f(res["cpu_pct"].get("broker")),
                    _f(res["cpu_pct"].get("main")),
                    _f(res.get("machine_busy_pct")),
                    _f(r.get("gpus_per_central_core")),
                    _f(res["rss_mb_peak"].get("worker")),
                    "yes" if r["sustained"] else f"no: {r['why']}",
                ]
            )
        )
    md.append("")
    return md


def _profile_section(p: dict[str, Any]) -> list[str]:
    if p.get("error"):
        return ["## Profile of the streams worker\n", f"Not taken: {p['error']}\n"]
    md = [
        f"## Profile of the streams worker at {p['nodes']} nodes (py-spy, 50 Hz)\n",
        f"{p['samples']} samples; the worker's Python threads were busy {_f(p.get('active_pct'))} % of the time "
        f"(worker CPU {_f(p.get('resources', {}).get('cpu_pct', {}).get('worker'))} % of one core). "
        f"Sustained during the profile: {p.get('sustained_during_profile')}.\n",
        "| own time: function | % | inclusive: function | % |",
        "|---|---|---|---|",
    ]
    own, incl = p.get("own", []), p.get("inclusive", [])
    for i in range(max(len(own), len(incl))):
        o = own[i] if i < len(own) else {"frame": "", "pct": ""}
        n = incl[i] if i < len(incl) else {"frame": "", "pct": ""}
        md.append(_row([f"`{o['frame']}`", o["pct"], f"`{n['frame']}`", n["pct"]]))
    md.append("")
    md.append(
        "Own time by file: " + ", ".join(f"`{x['frame']}` {x['pct']} %" for x in p.get("own_by_file", [])[:12]) + "\n"
    )
    text = " ".join(x["frame"] for x in own + incl + p.get("own_by_file", []))
    hints = [h for key, h in PROFILE_HINTS if key in text]
    if hints:
        md.append("What the profile points at (streams/ changes, not made here):\n")
        md += [f"- {h}" for h in hints]
        md.append("")
    return md


def _payload_section(p: dict[str, Any]) -> list[str]:
    mo, fa = p["model"], p["fast"]
    return [
        f"## Simulator publishing: pydantic models vs prebuilt JSON ({p['nodes']} nodes, {p['simulated_s']:.0f} simulated s)\n",
        "The one part of this path the benchmark owns. The simulator builds GpuSample / LogBatch / "
        "ProgressBatch as JSON objects instead of pydantic models + `schemas.codec.encode`; they decode to "
        "equal events with the real codec (tests/e2e/test_bench_smoke.py), and leave out fields at their "
        f"defaults, so they are also {100 * (1 - fa['mb'] / mo['mb']):.0f} % smaller on the wire.\n",
        "| payload | events | MB | µs per event | % of one core |",
        "|---|---|---|---|---|",
        _row(["pydantic models (before)", mo["events"], mo["mb"], mo["us_per_event"], mo["pct_of_one_core"]]),
        _row(["prebuilt JSON (after)", fa["events"], fa["mb"], fa["us_per_event"], fa["pct_of_one_core"]]),
        "",
    ]


def _gaps_section(ev: dict[str, Any]) -> list[str]:
    from sim.faults import FAULTS

    md = ["## What the simulator sends that no detector reads\n"]
    md += [
        "- Scheduler node events (`SchedEvent kind=node`, DOWN + NOT_RESPONDING, DRAIN): the attributor and the "
        "hang/straggler detectors read job events only. A node failure is found through srun's "
        "`Node failure on` line; a node that dies with no job output (srun on the dead node itself) would not be.",
        "- GPU metric faults: `lost`, `ecc_dbe_volatile`, `remapped_rows_failed`, `nvlink_errors` in GpuSample "
        "are not read by any detector; Xid 48/64/74/79 are found through the kernel log only.",
        "- Kernel `mlx5_core ... Link DOWN` lines: the catalog has `ib_link_down`, but producers.kernel publishes "
        "NVRM/SXid lines only, so the kernel's view of an IB flap never reaches it (the NCCL `port error` lines in "
        "the job log do).",
    ]
    for kind, k in ev["by_kind"].items():
        spec = FAULTS[kind]
        if spec.note:
            md.append(f"- `{kind}`: {spec.note}.")
        if k["recommended_only"]:
            md.append(f"- `{kind}`: {k['recommended_only']} of {k['detected']} incidents were recommendations only.")
    md.append("")
    return md
