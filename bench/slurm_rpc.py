"""RPC load the log discoverer puts on slurmctld (not a test): prints figures and writes
bench/results/slurm-rpc.json and bench/results/slurm-rpc.md, and the result in the common format,
bench/results/slurm_rpc/<date>-<commit>.json (bench/results.py).

What is measured, on the real slurmctld of each local cluster (22.05: infra/slurm/start.sh,
24.11: infra/slurm/start-2411.sh), with slurmctld's own counters (`sdiag`, reset with
`sdiag --reset` before each run). The discoverers run as uid 65534 (nobody) and only that
user's RPC count and total_time are read (sdiag's per-user table), so other users of the
shared slurmctld meanwhile do not count:

- old: every node runs the discoverer's `squeue --json` (the whole queue) once per interval;
- new: every node runs the node-local `squeue --json --nodelist NODE`
  (JobDiscovery(only_node=NODE), the argv the producer really builds);
- bus: every node runs the real bus discoverer (JobDiscovery with producers.placements.BusPlacements
  on the embedded broker, fed by the real Slurm producer): its first call reads the topic and
  resyncs once with `squeue --json --nodelist NODE` (counted: RPCs per resync), then the steady
  state is measured like the other ways (RPCs per poll: none expected). The central producer's
  `squeue --json --states=all` + `sinfo --json` per interval is measured as one poller. At 1,024
  nodes: the producer's RPCs per second + 1,024 x RPCs per resync / RESYNC_S + steady RPCs per
  poll x 1,024. Not counted (site-dependent): one `scontrol show job` per node of each job that
  starts (the discoverer describes a new job once, for its StdOut/StdErr).

N discoverers (threads, each starting its real `JobDiscovery.running_jobs()` once a second)
run for T seconds. This machine has 2 cores, so 1,024 discoverers cannot run: the RPCs and
slurmctld time per call measured at N = 8 and 32 are extrapolated LINEARLY to 1,024 nodes at
1 Hz (slurmctld's per-call cost grows with the queue size; the clusters here hold few jobs,
so the real cost per call at a site is higher and the figures are a lower bound).

Run as root (sdiag --reset): .venv/bin/python -m bench.slurm_rpc [--seconds 20] [--counts 8,32] [--versions 22.05,24.11]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench import figures, results
from bench.machine import machine
from bus.admin import ensure_topics
from bus.publish import Publisher
from producers.jobdiscovery import JobDiscovery
from producers.placements import BusPlacements
from producers.slurm import SlurmProducer
from slurmio.runners import LocalRunner, SlurmCommandError
from slurmio.squeue import SQUEUE_ALL
from trainmedic.stack.broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TARGET_NODES = 1024
#: The bus discoverer's Slurm resync interval (`produce logs --placements bus --resync`, default).
RESYNC_S = 300.0
# The discoverers run as this uid (nobody): sdiag's per-user counters then hold their RPCs
# only, whatever else uses the shared slurmctld meanwhile (other tests run as root).
BENCH_UID = 65534
_USER_LINE = re.compile(r"^\s*(\S+)\s+\(\s*(\d+)\)\s+count:(\d+)\s+ave_time:(\d+)\s+total_time:(\d+)")
# "REQUEST_JOB_INFO    ( 2003) count:2   ave_time:367    total_time:734"
_RPC_LINE = re.compile(r"^\s*([A-Z_0-9]+)\s+\(\s*\d+\)\s+count:(\d+)\s+ave_time:(\d+)\s+total_time:(\d+)")


@dataclass(frozen=True)
class Target:
    version: str
    conf: str
    path: str  # PATH for the clients (24.11: its wrappers first)
    as_bench_user: tuple[str, ...]  # argv prefix that runs a client as BENCH_UID on this cluster


class PrefixRunner:
    """A slurmio runner that runs each argv behind a prefix (here: as the bench user)."""

    def __init__(self, inner: LocalRunner, prefix: Sequence[str]) -> None:
        self.inner = inner
        self.prefix = tuple(prefix)

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        return self.inner([*self.prefix, *argv], timeout)


def _targets() -> list[Target]:
    out = []
    conf_2205 = Path(os.environ.get("TRAINMEDIC_SLURM_DIR", "/tmp/trainmedic-slurm")) / "etc" / "slurm.conf"
    base_path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    if conf_2205.is_file():
        setpriv = ("setpriv", f"--reuid={BENCH_UID}", f"--regid={BENCH_UID}", "--clear-groups")
        out.append(Target("22.05", str(conf_2205), base_path, setpriv))
    env_2411 = Path(os.environ.get("TRAINMEDIC_SLURM2411_DIR", "/tmp/trainmedic-slurm2411")) / "env.sh"
    if env_2411.is_file():
        env = dict(
            tok.split("=", 1)
            for tok in shlex.split(env_2411.read_text(), comments=True)
            if "=" in tok and "PATH" not in tok
        )
        bin_dir = env.get("TRAINMEDIC_SLURM2411_BIN", "")
        state = env_2411.parent
        holder = state / "data" / "run" / "holder.pid"
        if bin_dir and env.get("SLURM_CONF") and holder.is_file():
            # The wrappers of start-2411.sh run clients as root; this is the same call as another uid.
            chroot = (
                *("nsenter", "-t", holder.read_text().strip(), "-m", "--"),
                *("chroot", f"--userspec={BENCH_UID}:{BENCH_UID}", str(state / "root")),
                *(
                    "/usr/bin/env",
                    "-i",
                    "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                    "LC_ALL=C",
                    f"SLURM_CONF={env['SLURM_CONF']}",
                ),
            )
            out.append(Target("24.11", env["SLURM_CONF"], f"{bin_dir}:{base_path}", chroot))
    return out


def sdiag_rpcs(runner: LocalRunner) -> tuple[dict[str, tuple[int, int]], tuple[int, int]]:
    """From `sdiag`: message type -> (count, total_time µs) for all users (sdiag's own left out),
    and (count, total_time µs) of BENCH_UID's RPCs."""
    by_type: dict[str, tuple[int, int]] = {}
    mine = (0, 0)
    section = ""
    for line in runner(["sdiag"], 30).splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            section = "type"
        elif line.startswith("Remote Procedure Call statistics by user"):
            section = "user"
        elif line.strip() and not line.startswith(("\t", " ")):
            section = ""
        elif section == "type" and (m := _RPC_LINE.match(line)) and m.group(1) != "REQUEST_STATS_INFO":
            by_type[m.group(1)] = (int(m.group(2)), int(m.group(4)))
        elif section == "user" and (u := _USER_LINE.match(line)) and int(u.group(2)) == BENCH_UID:
            mine = (int(u.group(3)), int(u.group(5)))
    return by_type, mine


def measure(runner: LocalRunner, workers: int, seconds: float, call: Callable[[int], None]) -> dict[str, Any]:
    """Run `workers` loops of `call(i)` once a second for `seconds`; slurmctld's RPCs meanwhile."""
    runner(["sdiag", "--reset"], 30)
    stop = threading.Event()
    calls = [0] * workers
    errors = [0] * workers

    def loop(i: int) -> None:
        next_at = time.monotonic() + i / max(workers, 1)  # spread over the second, as real nodes are
        while not stop.is_set():
            stop.wait(max(0.0, next_at - time.monotonic()))
            if stop.is_set():
                return
            try:
                call(i)
                calls[i] += 1
            except (SlurmCommandError, ValueError):
                errors[i] += 1
            next_at += 1.0

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(workers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - t0
    by_type, (count, total_us) = sdiag_rpcs(runner)
    n = max(sum(calls), 1)
    return {
        "workers": workers,
        "seconds": round(elapsed, 2),
        "calls": sum(calls),
        "errors": sum(errors),
        "bench_user_rpcs": count,
        "bench_user_total_us": total_us,
        "rpcs_per_call": round(count / n, 3),
        "ctld_ms_per_call": round(total_us / n / 1000, 3),
        "calls_per_s": round(sum(calls) / elapsed, 2),
        "rpc_types_all_users": sorted(by_type),
    }


def answer_sizes(runner: LocalRunner, node: str) -> dict[str, Any]:
    """What one node's query returns, whole queue vs --nodelist NODE, with a pending job on no node.

    A held job is submitted for the measurement and cancelled right after it.
    """
    job = runner(["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap", "true"], 30).strip().split(";")[0]
    try:
        whole = runner(["squeue", "--json"], 30)
        mine = runner(["squeue", "--json", "--nodelist", node], 30)
    finally:
        runner(["scancel", job], 30)
    return {
        "node": node,
        "whole_jobs": len(json.loads(whole).get("jobs", [])),
        "whole_bytes": len(whole.encode()),
        "nodelist_jobs": len(json.loads(mine).get("jobs", [])),
        "nodelist_bytes": len(mine.encode()),
    }


def _summary(run: dict[str, Any]) -> str:
    return (
        f"{run['calls']} calls in {run['seconds']} s ({run['calls_per_s']}/s, {run['errors']} errors): "
        f"{run['rpcs_per_call']} RPCs and {run['ctld_ms_per_call']} ms of slurmctld per call"
    )


def bench_target(target: Target, seconds: float, counts: list[int]) -> dict[str, Any]:
    runner = LocalRunner(target.conf, path=target.path)  # root: sdiag --reset, sbatch, scancel
    bench = PrefixRunner(LocalRunner(target.conf, path=target.path), target.as_bench_user)  # the discoverers
    queue = len(json.loads(runner(list(SQUEUE_ALL), 30)).get("jobs", []))
    nodes = [line.split()[0] for line in runner(["sinfo", "-h", "-N", "-o", "%N"], 30).splitlines() if line.strip()]
    answers = answer_sizes(runner, nodes[0])
    print(f"  {target.version} answers: {answers}", flush=True)
    none = cast(Publisher, None)  # running_jobs() publishes nothing; only its Slurm query is measured
    out: dict[str, Any] = {"version": target.version, "queue_jobs": queue, "answers": answers, "modes": {}}

    broker = EmbeddedBroker().start()
    ensure_topics(broker.bootstrap)
    pub = Publisher(broker.bootstrap, "bench-slurm-producer")
    with tempfile.TemporaryDirectory() as tmp:
        # The real producer on the bus: its cold-start marker and every change from here on.
        SlurmProducer(pub, runner=runner, state_path=Path(tmp) / "state.json").poll_once()
    assert pub.flush(10) == 0
    sources: list[BusPlacements] = []

    def discoverers(mode: str, n: int) -> list[JobDiscovery]:
        if mode == "old":
            return [JobDiscovery(none, bench) for _ in range(n)]
        ds = [JobDiscovery(none, bench, only_node=nodes[k % len(nodes)]) for k in range(n)]
        if mode == "bus":
            for d in ds:
                assert d.only_node is not None
                src = BusPlacements(broker.bootstrap, d.only_node, resync=d.running_jobs, resync_s=RESYNC_S)
                d.follow_placements(src)
                sources.append(src)
        return ds

    try:
        for mode in ("old", "new", "bus"):
            rows = []
            for n in counts:
                ds = discoverers(mode, n)
                resync: dict[str, Any] = {}
                if mode == "bus":
                    resync = _first_resyncs(runner, ds, sources[-n:])
                    print(f"  {target.version} bus N={n:3}: first resyncs {resync}", flush=True)

                def poll(i: int, ds: list[JobDiscovery] = ds) -> None:
                    ds[i].running()

                run = measure(runner, n, seconds, poll) | resync
                rows.append(run)
                print(f"  {target.version} {mode:3} N={n:3}: {_summary(run)}", flush=True)
            out["modes"][mode] = rows
    finally:
        for src in sources:
            src.close()
        pub.close()
        broker.stop()

    def producer_poll(i: int) -> None:  # the central Slurm producer's two commands per interval
        bench(list(SQUEUE_ALL), 30)
        bench(["sinfo", "--json"], 30)

    run = measure(runner, 1, seconds, producer_poll)
    out["producer"] = run
    print(f"  {target.version} central producer: {_summary(run)}", flush=True)
    return out


def _first_resyncs(runner: LocalRunner, ds: list[JobDiscovery], sources: list[BusPlacements]) -> dict[str, Any]:
    """Each bus discoverer's first calls (the topic read, then one Slurm resync); their RPCs."""
    runner(["sdiag", "--reset"], 30)
    deadline = time.monotonic() + 60
    while any(src.resyncs == 0 for src in sources) and time.monotonic() < deadline:
        for d in ds:
            d.running()
    if any(src.resyncs == 0 for src in sources):
        raise SystemExit("a bus discoverer did not resync within 60 s")
    _, (count, total_us) = sdiag_rpcs(runner)
    return {
        "resyncs": len(sources),
        "rpcs_per_resync": round(count / len(sources), 3),
        "ctld_ms_per_resync": round(total_us / len(sources) / 1000, 3),
    }


def extrapolate(result: dict[str, Any]) -> dict[str, Any]:
    """RPCs and slurmctld time per call (from the largest N), at TARGET_NODES nodes polling at 1 Hz.

    Linear: each node's poll costs slurmctld the same RPCs and time as one measured call.
    """
    out = {}
    for mode, rows in result["modes"].items():
        row = max(rows, key=lambda r: r["workers"])
        out[mode] = {
            "rpcs_per_call": row["rpcs_per_call"],
            "rpcs_per_s": round(row["rpcs_per_call"] * TARGET_NODES, 1),
            "ctld_ms_per_call": row["ctld_ms_per_call"],
            "ctld_busy_s_per_s": round(row["ctld_ms_per_call"] * TARGET_NODES / 1000, 3),
        }
    # Bus: the steady polls (measured as above), plus every node's resync once per RESYNC_S,
    # plus the one central producer's poll per second, whatever the node count.
    row = max(result["modes"]["bus"], key=lambda r: r["workers"])
    prod = result["producer"]
    resync_rps = TARGET_NODES * row["rpcs_per_resync"] / RESYNC_S
    resync_busy = TARGET_NODES * row["ctld_ms_per_resync"] / 1000 / RESYNC_S
    out["bus"] = {
        "rpcs_per_call": row["rpcs_per_call"],
        "rpcs_per_resync": row["rpcs_per_resync"],
        "rpcs_per_s": round(out["bus"]["rpcs_per_s"] + resync_rps + prod["rpcs_per_call"], 1),
        "ctld_ms_per_call": row["ctld_ms_per_call"],
        "ctld_busy_s_per_s": round(out["bus"]["ctld_busy_s_per_s"] + resync_busy + prod["ctld_ms_per_call"] / 1000, 4),
    }
    return out


def write_md(results: list[dict[str, Any]], seconds: float, counts: list[int]) -> str:
    lines = [
        "# RPC load of log discovery on slurmctld (bench/slurm_rpc.py)",
        "",
        f"Measured ({', '.join(r['version'] + ': ' + r['measured_at'] for r in results)}) on "
        f"{machine()['cpu']} ({machine()['cores']} cores): "
        f"real slurmctld, counts from `sdiag` (reset before each run), {seconds:g} s per run, "
        f"N = {', '.join(map(str, counts))} discoverers at 1 Hz. The discoverers run as uid {BENCH_UID} (nobody) and "
        "only that user's RPCs are counted (sdiag's per-user counters), so other users of the shared slurmctld "
        "do not blur the figures.",
        "",
        f"**Extrapolated linearly** from the largest N to {TARGET_NODES:,} nodes (2 cores cannot run 1,024 "
        "discoverers). slurmctld's cost per call grows with the queue; the clusters here hold few jobs "
        "(column `jobs held`: squeue --states=all, finished ones included), so the ms per call at a busy site are higher: read them as a lower bound. "
        "ms per call = sdiag total_time of the bench user's RPCs / calls (all RPC types one call makes). "
        "The RPC counts are exact; the ms vary with the queue's content at the time (other tests share these "
        "clusters), so compare them within one run, not across.",
        "",
        f"| Slurm | jobs held | way | RPCs per call | slurmctld ms per call | RPC/s at {TARGET_NODES:,} nodes "
        f"| slurmctld busy s/s at {TARGET_NODES:,} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ext = r["extrapolated"]
        for mode, label in (
            ("old", "old: `squeue --json` on every node"),
            ("new", "new: `squeue --json --nodelist NODE` on every node"),
            (
                "bus",
                f"bus: placements from `sched.events` (RPCs per poll; + a resync per node every {RESYNC_S:g} s "
                "+ one producer poll/s, in the rate)",
            ),
        ):
            e = ext[mode]
            per_call = e["rpcs_per_call"]
            lines.append(
                f"| {r['version']} | {r['queue_jobs']} | {label} | {per_call} | {e['ctld_ms_per_call']} "
                f"| {e['rpcs_per_s']} | {e['ctld_busy_s_per_s']} |"
            )
    lines += ["", "What one node's query returns (a held pending job, on no node, in the queue meanwhile):", ""]
    for r in results:
        a = r["answers"]
        lines.append(
            f"- {r['version']}: `squeue --json` {a['whole_jobs']} jobs / {a['whole_bytes']:,} bytes; "
            f"`squeue --json --nodelist {a['node']}` {a['nodelist_jobs']} jobs / {a['nodelist_bytes']:,} bytes"
        )
    lines += ["", "Raw runs:", ""]
    for r in results:
        for mode, rows in r["modes"].items():
            for row in rows:
                lines.append(
                    f"- {r['version']} {mode} N={row['workers']}: {_summary(row)}; RPC types meanwhile (all users): "
                    f"{', '.join(row['rpc_types_all_users'])}"
                )
        lines.append(f"- {r['version']} central producer (squeue --states=all + sinfo): {_summary(r['producer'])}")
        for row in r["modes"].get("bus", []):
            lines.append(
                f"- {r['version']} bus N={row['workers']} first resyncs: {row['rpcs_per_resync']} RPCs and "
                f"{row['ctld_ms_per_resync']} ms of slurmctld each"
            )
    lines += [
        "",
        "Reading: `--nodelist` never makes the RPC smaller: squeue still sends the full REQUEST_JOB_INFO "
        "(not a per-node request) and adds a REQUEST_NODE_INFO to resolve the node name, so per node it "
        "costs two RPCs instead of one. On 22.05 `--json` also ignores the filter (the whole queue is "
        "printed); on 24.11 the printed answer is filtered after the full RPC. Only taking placements from "
        "the bus removes the per-node load: what remains is the one central producer's poll "
        "(squeue + sinfo), independent of the node count, and each node's slow resync "
        f"(every {RESYNC_S:g} s: the jobs the bus never announced, such as those running at a cold start "
        "of the producer).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--counts", default="8,32")
    ap.add_argument("--versions", default="22.05,24.11", help="Which local clusters to measure.")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",") if c]
    wanted = set(args.versions.split(","))
    targets = [t for t in _targets() if t.version in wanted]
    if not targets:
        raise SystemExit(f"no local Slurm cluster of {sorted(wanted)} found (infra/slurm/start.sh, start-2411.sh)")
    # A run measures some versions; the others keep their last measured entry (each says when), from the
    # last report or else from the last result file.
    out_json = RESULTS / "slurm-rpc.json"
    kept: dict[str, dict[str, Any]] = {}
    last = results.latest(results.load(RESULTS), "slurm_rpc")
    previous = json.loads(out_json.read_text()) if out_json.is_file() else (last.doc.get("details", {}) if last else {})
    if previous.get("seconds") == args.seconds and previous.get("counts") == counts:
        kept = {r["version"]: r for r in previous.get("results", [])}
    started = results.now()
    for target in targets:
        print(f"Slurm {target.version} ({target.conf})", flush=True)
        r = bench_target(target, args.seconds, counts)
        r["measured_at"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        r["extrapolated"] = extrapolate(r)
        print(f"  at {TARGET_NODES} nodes: {json.dumps(r['extrapolated'])}", flush=True)
        kept[target.version] = r
    measured = [kept[v] for v in sorted(kept)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"seconds": args.seconds, "counts": counts, "results": measured}
    out_json.write_text(json.dumps(doc, indent=2) + "\n")
    md = write_md(measured, args.seconds, counts)
    (RESULTS / "slurm-rpc.md").write_text(md)
    carried = sorted(set(kept) - {t.version for t in targets})
    results.record(
        "slurm_rpc",
        figures.slurm_rpc(doc),
        root=RESULTS,
        started=started,
        machine=machine(),
        details=doc,
        report=RESULTS / "slurm-rpc.md",
        notes=f"Slurm {', '.join(carried)}: carried over from the previous result (see its measured_at)"
        if carried
        else None,
    )
    print(md)


if __name__ == "__main__":
    main()
