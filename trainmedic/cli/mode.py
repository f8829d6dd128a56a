"""`trainmedic mode show|set`: autonomy per partition and category, through the operator API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from schemas.printable import printable
from schemas.vocab import CATEGORIES, MODES
from trainmedic.cli.base import ApiOpt, DataDir, OperatorOpt, api, expect, new_app, whoami

mode_app = new_app(help="Autonomy per partition and category (audited; takes effect without a restart).")


@mode_app.command("show")
def show(data_dir: DataDir = Path("var"), api_url: ApiOpt = None) -> None:
    """Print the modes in force: default, per category, per partition."""
    typer.echo(json.dumps(api(data_dir, api_url, "GET", "/api/modes"), indent=2))


@mode_app.command("set")
def set_cmd(
    mode: Annotated[str, typer.Argument(metavar="MODE", help="monitor or autonomous")],
    partition: Annotated[Optional[str], typer.Option(help="Only this partition.")] = None,
    category: Annotated[Optional[str], typer.Option(help="Only this category.")] = None,
    reason: Annotated[str, typer.Option(help="Why (recorded).")] = "",
    force: Annotated[bool, typer.Option(help="Record that a readiness verdict was overridden.")] = False,
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
) -> None:
    """Switch monitor/autonomous for everything, a partition, a category, or both."""
    expect(mode, MODES, "mode")
    expect(category, CATEGORIES, "--category")
    r = api(
        data_dir,
        api_url,
        "POST",
        "/api/modes",
        {
            "mode": mode,
            "partition": partition,
            "category": category,
            "operator": operator or whoami(),
            "reason": reason,
            "force": force,
        },
    )
    typer.echo(
        printable(
            f"mode for partition={r['partition'] or '*'} category={r['category'] or '*'}: "
            f"{r['old_mode'] or '(unknown: no valid policy)'} -> {r['new_mode']}"
        )
    )
    if r.get("policy_error"):
        # The change is made; the operator should still learn that the file on disk is not in force.
        typer.echo(printable(f"warning: the policy file failed to load: {r['policy_error']}"), err=True)
