"""`trainmedic recommendations list|approve|reject|label`: what monitor mode proposed, and the operator's answer.

All four go through the operator API of a running `trainmedic up`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from schemas.errors import UsageError
from schemas.printable import printable
from schemas.vocab import REJECT_REASONS
from trainmedic.cli.base import ApiOpt, AsJson, DataDir, OperatorOpt, api, expect, new_app, print_rows, whoami

recommendations_app = new_app(
    help="Recommendations of monitor mode: list them, approve or reject one, label one after the fact."
)

DecisionId = Annotated[str, typer.Argument(metavar="DECISION_ID", help="The recommendation's decision id (dec-...).")]


@recommendations_app.command("list")
def list_cmd(
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
    as_json: AsJson = False,
) -> None:
    """List recommendations waiting for an operator."""
    print_rows(
        api(data_dir, api_url, "GET", "/api/recommendations"),
        as_json,
        lambda r: (
            f"{r['decision_id']}  {r['event_time'][:19]}  job {r['job_id'] or '-':8} {r['category']:13} "
            f"{r['action']:18} culprit {r['culprit_node'] or '-':8} {r['verdict'] or 'pending'}"
        ),
    )


@recommendations_app.command()
def approve(
    decision_id: DecisionId,
    comment: Annotated[str, typer.Option(help="Why.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
) -> None:
    """Approve a recommendation: the executor carries it out, recorded with who approved."""
    r = api(
        data_dir,
        api_url,
        "POST",
        f"/api/recommendations/{decision_id}/approve",
        {"operator": operator or whoami(), "comment": comment},
    )
    typer.echo(printable(f"approved {decision_id}: action {r['action_id']} sent to the executor"))


@recommendations_app.command()
def reject(
    decision_id: DecisionId,
    reason: Annotated[str, typer.Option(help=f"One of: {', '.join(REJECT_REASONS)}.")],
    comment: Annotated[str, typer.Option(help="Free text.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
) -> None:
    """Reject a recommendation, with a reason from a fixed list (it feeds readiness scoring)."""
    expect(reason, REJECT_REASONS, "--reason")
    api(
        data_dir,
        api_url,
        "POST",
        f"/api/recommendations/{decision_id}/reject",
        {"operator": operator or whoami(), "reason": reason, "comment": comment},
    )
    typer.echo(printable(f"rejected {decision_id} ({reason})"))


@recommendations_app.command()
def label(
    decision_id: DecisionId,
    verdict: Annotated[str, typer.Argument(metavar="VERDICT", help="confirmed, approved or rejected.")],
    reason: Annotated[Optional[str], typer.Option(help=f"For rejected: {', '.join(REJECT_REASONS)}.")] = None,
    comment: Annotated[str, typer.Option(help="Free text, e.g. the RMA ticket.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
) -> None:
    """Label a recommendation after the fact (e.g. confirmed: the node failed its diagnostics)."""
    expect(verdict, ("confirmed", "approved", "rejected"), "verdict")
    if verdict == "rejected" and reason not in REJECT_REASONS:
        raise UsageError(f"--reason {reason!r}: a rejection needs one of {', '.join(REJECT_REASONS)}")
    api(
        data_dir,
        api_url,
        "POST",
        f"/api/recommendations/{decision_id}/label",
        {"verdict": verdict, "reason": reason, "operator": operator or whoami(), "comment": comment},
    )
    typer.echo(printable(f"labelled {decision_id}: {verdict}"))
