"""The `trainmedic` command."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Workload-level recovery for distributed AI training on Slurm."
)

DataDir = Annotated[Path, typer.Option("--data-dir", help="Where the embedded chDB audit and logs live.")]


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def up(
    data_dir: DataDir = Path("var"),
    bootstrap: Annotated[
        Optional[str], typer.Option(help="Use this Kafka (HOST:PORT) instead of the embedded broker.")
    ] = None,
    clickhouse: Annotated[
        Optional[str], typer.Option(help="ClickHouse URL (http://user:pw@host:8123) instead of embedded chDB.")
    ] = None,
    policy: Annotated[Optional[Path], typer.Option(help="Policy YAML (default infra/policies/default.yaml).")] = None,
    mode: Annotated[
        Optional[str], typer.Option(help="Override the policy's mode everywhere: monitor|autonomous.")
    ] = None,
    backend: Annotated[
        str, typer.Option(help="Scheduler backend: slurm-cli (local Slurm) or simulated.")
    ] = "slurm-cli",
) -> None:
    """Start the broker (or use --bootstrap), streams worker, executor and audit sink; Ctrl-C stops all."""
    from streams.policy import PolicyError, load_policy
    from trainmedic.broker import BrokerError
    from trainmedic.runtime import Stack, StackConfig, StackError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if mode not in (None, "monitor", "autonomous"):
        _fail(f"--mode {mode!r}: expected monitor or autonomous")
    try:
        load_policy(policy)
    except PolicyError as exc:
        _fail(str(exc))
    sched: Any
    if backend == "slurm-cli":
        from sinks.backends.slurm_cli import SlurmCliBackend

        sched = SlurmCliBackend()
    elif backend == "simulated":
        from sinks.backends.simulated import SimulatedScheduler

        sched = SimulatedScheduler([])
    else:
        _fail(f"--backend {backend!r}: expected slurm-cli or simulated")
    try:
        stack = Stack(
            StackConfig(data_dir=data_dir, bootstrap=bootstrap, clickhouse=clickhouse, policy=policy, mode=mode), sched
        ).start()
    except (StackError, BrokerError) as exc:
        _fail(str(exc))
    typer.echo(
        f"trainmedic is up: Kafka {stack.bootstrap}, audit {stack.store.url if stack.store else '?'}, "
        f"scheduler {sched.name}, logs in {stack.logs_dir}. Ctrl-C stops."
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    typer.echo("stopping: executor, audit sink, streams worker, broker ...")
    stack.stop()
    typer.echo("trainmedic stopped cleanly.")


@app.command()
def demo(
    data_dir: DataDir = Path("var"),
    mode: Annotated[str, typer.Option(help="monitor (recommend only) or autonomous (act).")] = "autonomous",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    slurm: Annotated[
        bool, typer.Option("--slurm", help="Act on the local Slurm cluster instead of the simulator.")
    ] = False,
) -> None:
    """Run the whole loop: a simulated training job, a Xid 79, and trainmedic finding and fixing it."""
    from trainmedic.demo import DemoError, run_demo
    from trainmedic.runtime import StackError

    if mode not in ("monitor", "autonomous"):
        _fail(f"--mode {mode!r}: expected monitor or autonomous")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    say = (lambda _m: None) if as_json else typer.echo
    if not as_json:
        typer.echo(
            f"demo: mode {mode}"
            + (
                " (the default for the demo, so that the whole loop is visible; deployments default to monitor)"
                if mode == "autonomous"
                else ""
            )
        )
    try:
        report = run_demo(data_dir, mode=mode, slurm=slurm, say=say)
    except (DemoError, StackError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    if not report["correct"]:
        raise typer.Exit(1)


@app.command()
def diagnose(
    paths: Annotated[list[Path], typer.Argument(help="Job logs and kernel logs (kern.log*, dmesg*, syslog*).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Post-mortem: run the detectors and attribution offline over log files (no broker needed)."""
    from trainmedic.diagnose import DiagnoseError, diagnose_paths

    try:
        report = diagnose_paths(paths)
    except DiagnoseError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    culprit = report["culprit"] or "no single node"
    if report["culprit_rank"] is not None:
        culprit += f" (rank {report['culprit_rank']})"
    typer.echo(
        f"category    {report['category']}\nculprit     {culprit}\naction      {report['action']}\n"
        f"confidence  {report['confidence']}\nwhy         {report['explanation']}"
    )
    for e in report["evidence"][:20]:
        where = e["node"] or "?"
        if e["rank"] is not None:
            where += f" rank {e['rank']}"
        typer.echo(f"  [{e['role']:10}] {e['signature']:28} {where:16} {e['line'][:160]}")


def _print_report(r: dict[str, Any]) -> None:
    inc, dec, res = r["incident"], r["decision"], r["action_result"]
    lines = [
        "",
        f"incident     {inc['incident_id']}  job {inc['job_id']}",
        f"  category   {inc['category']}   culprit {inc['culprit']}   confidence {inc['confidence']}",
        f"  why        {inc['explanation']}",
        f"  evidence   {inc['evidence_lines']} signals in this one incident: {'; '.join(inc['evidence_summary'])}",
        f"decision     {dec['action']} ({dec['kind']}, mode {dec['mode']}; rule {dec['rule']})",
    ]
    if res:
        lines.append(
            f"action       {res['status']}: "
            + "; ".join(res["steps"])
            + (f" ERROR {res['error']}" if res["error"] else "")
        )
    else:
        lines.append("action       none taken: monitor mode records a recommendation; the scheduler was not called")
    lines += [
        f"latency      detection {r['detection_latency_s']:.2f} s (Xid line written -> incident published)"
        + (
            f"; action {r['action_latency_s']:.2f} s (incident -> drain + requeue verified)"
            if r["action_latency_s"] is not None
            else ""
        ),
        "             (NVIDIA's published means: detection 69 s, recovery action 94 s)",
        f"healthy job  {r['healthy_job']['job_id'] or '(none on this cluster)'}: {r['healthy_job']['incidents']} incidents",
        f"scheduler    {', '.join(r['scheduler_calls']) or 'no calls'}; job now {r['job_after']['state']} on "
        f"{','.join(r['job_after']['nodes']) or '-'}",
        f"verdict      {'culprit and category correct' if r['correct'] else 'WRONG attribution'}",
    ]
    typer.echo("\n".join(lines))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
