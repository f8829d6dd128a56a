"""`trainmedic readiness`, `trainmedic replay`, `trainmedic label`: is monitor mode good enough yet?

With a running `trainmedic up` (DATA_DIR/runtime.json) they go through its operator
API, since that process owns the chDB folder; otherwise they open the audit directly.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from schemas.vocab import REJECT_REASONS
from streams.policy import PolicyError, load_overlay, load_policy, parse_policy
from trainmedic.client import ClientError, api_token, api_url, call

DataDir = Annotated[Path, typer.Option("--data-dir", help="trainmedic's data folder (var; the demo: var/demo).")]
ClickHouse = Annotated[Optional[str], typer.Option("--clickhouse", help="ClickHouse server URL instead of chDB.")]
Database = Annotated[str, typer.Option("--database", help="Audit database name.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _days(text: str) -> float:
    from sinks.audit_queries import parse_since

    try:
        return parse_since(text).total_seconds() / 86400
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--since'") from None


def _via_api(data_dir: Path, clickhouse: str | None) -> tuple[str, str] | None:
    if clickhouse or not (data_dir / "runtime.json").exists():
        return None
    try:
        return api_url(data_dir, None), api_token(data_dir, None)
    except ClientError:
        return None


def readiness_cmd(
    since: Annotated[str, typer.Option(help="History to score: 30d, 7d, 24h.")] = "30d",
    policy: Annotated[Optional[Path], typer.Option(help="Policy whose readiness thresholds apply.")] = None,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Per category and partition: recommendations, precision, misses, latency, and a verdict for autonomy."""
    days = _days(since)
    api = _via_api(data_dir, clickhouse)
    rows: list[dict[str, Any]]
    if api is not None:
        try:
            rows = call(api[0], api[1], "GET", f"/api/readiness?since_days={days}")
        except ClientError as exc:
            _fail(str(exc))
    else:
        from trainmedic.audit_cli import open_store
        from trainmedic.readiness import readiness

        try:
            pol = load_policy(policy).with_overlay(load_overlay(data_dir / "modes.yaml"))
        except PolicyError as exc:
            _fail(str(exc))
        store = open_store(data_dir, clickhouse, database)
        try:
            rows = [s.as_dict() for s in readiness(store, pol, since_s=time.time() - days * 86400)]
        finally:
            store.close()
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    typer.echo(
        f"{'category':13} {'partition':10} {'recs':>5} {'appr':>5} {'rej':>4} {'conf':>5} {'exp':>4} "
        f"{'prec':>5} {'miss':>5} {'det p50':>8} {'act p50':>8}  verdict"
    )
    for r in rows:
        prec = "-" if r["precision"] is None else f"{r['precision']:.0%}"
        det = "-" if r["detection_p50_s"] is None else f"{r['detection_p50_s']:.1f}s"
        act = "-" if r["action_p50_s"] is None else f"{r['action_p50_s']:.1f}s"
        why = f" ({'; '.join(r['missing'])})" if r["missing"] else ""
        typer.echo(
            f"{r['category']:13} {r['partition'] or '*':10} {r['recommendations']:5} {r['approved']:5} "
            f"{r['rejected']:4} {r['confirmed']:5} {r['expired']:4} {prec:>5} {r['misses']:5} {det:>8} "
            f"{act:>8}  {r['verdict']}{why}"
        )


def replay_cmd(
    policy: Annotated[Path, typer.Option(help="The policy to try (YAML).")],
    since: Annotated[str, typer.Option(help="History to replay: 7d, 24h.")] = "7d",
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Replay recorded incidents through another policy, side by side with what happened. Executes nothing."""
    from trainmedic.replay import render, replay

    days = _days(since)
    try:
        text = policy.read_text()
        new_policy = parse_policy(text, str(policy))
    except OSError as exc:
        _fail(f"--policy {policy}: {exc.strerror}")
    except PolicyError as exc:
        _fail(str(exc))
    api = _via_api(data_dir, clickhouse)
    if api is not None:
        try:
            report = call(
                api[0],
                api[1],
                "POST",
                "/api/replay",
                {"policy_yaml": text, "policy_name": str(policy), "since_days": days},
            )
        except ClientError as exc:
            _fail(str(exc))
    else:
        from trainmedic.audit_cli import open_store

        store = open_store(data_dir, clickhouse, database)
        try:
            report = replay(store, new_policy, since_s=time.time() - days * 86400)
        finally:
            store.close()
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        typer.echo("\n".join(render(report)))


def label_cmd(
    decision_id: Annotated[str, typer.Argument(help="The decision id (dec-...).")],
    verdict: Annotated[str, typer.Argument(help="confirmed, approved or rejected.")],
    reason: Annotated[Optional[str], typer.Option(help=f"For rejected: {', '.join(REJECT_REASONS)}.")] = None,
    comment: Annotated[str, typer.Option(help="Free text, e.g. the RMA ticket.")] = "",
    operator: Annotated[str, typer.Option(help="Who labels (recorded).")] = "",
    data_dir: DataDir = Path("var"),
    api: Annotated[Optional[str], typer.Option("--api", help="Operator API URL.")] = None,
    token: Annotated[Optional[str], typer.Option("--token", help="API token.")] = None,
) -> None:
    """Label a recommendation after the fact (e.g. confirmed: the node failed its diagnostics)."""
    if verdict not in ("confirmed", "approved", "rejected"):
        _fail(f"verdict {verdict!r}: expected confirmed, approved or rejected")
    if verdict == "rejected" and reason not in REJECT_REASONS:
        _fail(f"--reason {reason!r}: a rejection needs one of {', '.join(REJECT_REASONS)}")
    who = operator or os.environ.get("USER") or "operator"
    try:
        call(
            api_url(data_dir, api),
            api_token(data_dir, token),
            "POST",
            f"/api/recommendations/{decision_id}/label",
            {"verdict": verdict, "reason": reason, "operator": who, "comment": comment},
        )
    except ClientError as exc:
        _fail(str(exc))
    typer.echo(f"labelled {decision_id}: {verdict}")
