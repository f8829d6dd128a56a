"""`trainmedic policy check FILE`, `policy explain --incident ID`, `policy replay --policy FILE`: dry-run a policy."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from schemas.errors import NotFound, UsageError
from schemas.printable import printable
from sinks.guardrails import parse_guardrails
from streams.policy import explain, load_overlay, load_policy, parse_policy
from trainmedic.cli.base import AsJson, new_app, running_api, since_days

policy_app = new_app(
    help="Check a policy file; explain what it decides for a recorded incident; replay history through it."
)


@policy_app.command("check")
def check(path: Annotated[Path, typer.Argument(help="Policy YAML.")]) -> None:
    """Validate a policy (schema, rules, guardrails, readiness) and summarise it."""
    try:
        text = path.read_text()
        policy = parse_policy(text, str(path))
        rails = parse_guardrails(text, str(path))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
    typer.echo(f"{path}: valid")
    typer.echo(
        f"  mode {policy.mode}; categories {policy.categories or '-'}; "
        f"partitions {({k: v.model_dump(exclude_defaults=True) for k, v in policy.partitions.items()}) or '-'}"
    )
    for r in policy.rules:
        typer.echo(
            f"  rule {r.name}: {r.match.model_dump(exclude_none=True)} -> {r.action}"
            + (f" ({r.stop})" if r.action == "stop" else "")
        )
    typer.echo("  actions " + ", ".join(f"{c}={a}" for c, a in policy.actions.items()))
    typer.echo(
        f"  restart budget {policy.restart_budget.max_restarts} per {policy.restart_budget.window_h:g} h, "
        f"then {policy.restart_budget.then} ({policy.restart_budget.stop}); min_confidence "
        f"{policy.min_confidence}"
    )
    js = policy.job_settings
    typer.echo(
        f"  job settings: {'read from job comments (trainmedic=...)' if js.from_comment else 'comments ignored'}"
    )
    for jr in js.rules:
        typer.echo(f"  job rule {jr.name}: {jr.match.model_dump(exclude_none=True)} -> trainmedic={jr.set}")
    typer.echo(f"  guardrails {rails.model_dump()}")


@policy_app.command("explain")
def explain_cmd(
    incident: Annotated[str, typer.Option("--incident", help="A recorded incident id (inc-...).")],
    policy: Annotated[Optional[Path], typer.Option(help="Policy to try (default: the one in force).")] = None,
    data_dir: Annotated[Path, typer.Option("--data-dir", help="trainmedic's data folder.")] = Path("var"),
    clickhouse: Annotated[Optional[str], typer.Option("--clickhouse", help="ClickHouse URL instead of chDB.")] = None,
    database: Annotated[str, typer.Option("--database")] = "trainmedic",
) -> None:
    """Replay one recorded incident through a policy and show which rule decides, and why. Executes nothing."""
    from trainmedic.cli.audit import open_store
    from trainmedic.ops.replay import load_incident

    pol = load_policy(policy).with_overlay(load_overlay(data_dir / "modes.yaml"))
    store = open_store(data_dir, clickhouse, database)
    try:
        inc = load_incident(store, incident)
    finally:
        store.close()
    if inc is None:
        raise NotFound(f"no incident {incident} in the audit")
    typer.echo("\n".join(map(printable, explain(pol, inc))))  # one line each: a recorded value forges none


@policy_app.command("replay")
def replay_cmd(
    policy: Annotated[Path, typer.Option(help="The policy to try (YAML).")],
    since: Annotated[str, typer.Option(help="History to replay: 7d, 24h.")] = "7d",
    data_dir: Annotated[Path, typer.Option("--data-dir", help="trainmedic's data folder.")] = Path("var"),
    clickhouse: Annotated[Optional[str], typer.Option("--clickhouse", help="ClickHouse URL instead of chDB.")] = None,
    database: Annotated[str, typer.Option("--database")] = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Replay recorded incidents through another policy, side by side with what happened. Executes nothing."""
    from trainmedic.cli.client import call
    from trainmedic.ops.replay import render, replay

    days = since_days(since)
    try:
        text = policy.read_text()
    except OSError as exc:
        raise UsageError(f"--policy {policy}: {exc.strerror}") from None
    new_policy = parse_policy(text, str(policy))
    api = running_api(data_dir, clickhouse)
    if api is not None:
        report = call(
            api[0], api[1], "POST", "/api/replay", {"policy_yaml": text, "policy_name": str(policy), "since_days": days}
        )
    else:
        from trainmedic.cli.audit import open_store

        store = open_store(data_dir, clickhouse, database)
        try:
            report = replay(store, new_policy, since_s=time.time() - days * 86400)
        finally:
            store.close()
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        typer.echo("\n".join(map(printable, render(report))))
