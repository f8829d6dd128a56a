"""`trainmedic policy check FILE` and `trainmedic policy explain --incident ID`: dry-run the policy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sinks.guardrails import GuardrailConfigError, parse_guardrails
from streams.policy import PolicyError, explain, load_overlay, load_policy, parse_policy

policy_app = typer.Typer(
    help="Check a policy file; explain what it decides for a recorded incident.", no_args_is_help=True
)


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@policy_app.command("check")
def check(path: Annotated[Path, typer.Argument(help="Policy YAML.")]) -> None:
    """Validate a policy (schema, rules, guardrails, readiness) and summarise it."""
    try:
        text = path.read_text()
        policy = parse_policy(text, str(path))
        rails = parse_guardrails(text, str(path))
    except OSError as exc:
        _fail(f"{path}: cannot read: {exc.strerror}")
    except (PolicyError, GuardrailConfigError) as exc:
        _fail(str(exc))
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
    from trainmedic.audit_cli import open_store
    from trainmedic.replay import load_incident

    try:
        pol = load_policy(policy).with_overlay(load_overlay(data_dir / "modes.yaml"))
    except PolicyError as exc:
        _fail(str(exc))
    store = open_store(data_dir, clickhouse, database)
    try:
        inc = load_incident(store, incident)
    finally:
        store.close()
    if inc is None:
        _fail(f"no incident {incident} in the audit")
    assert inc is not None
    typer.echo("\n".join(explain(pol, inc)))
