"""`trainmedic nodes list|resume`: nodes as the scheduler sees them, through the operator API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from schemas.ids import check_node_name
from schemas.printable import printable
from trainmedic.cli.base import ApiOpt, AsJson, DataDir, OperatorOpt, api, new_app, print_rows, whoami

nodes_app = new_app(help="Nodes as the scheduler sees them; return one trainmedic drained to service.")


@nodes_app.command("list")
def list_cmd(
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
    as_json: AsJson = False,
) -> None:
    """Nodes as the scheduler sees them; drained ones with their reason and incident."""
    print_rows(
        api(data_dir, api_url, "GET", "/api/nodes"),
        as_json,
        lambda r: (
            f"{r['node']:12} {r['state']:10} {','.join(r['flags']) or '-':16} {r['incident_id'] or '':26} "
            f"{r['reason'] or ''}"
        ),
    )


@nodes_app.command()
def resume(
    node: Annotated[str, typer.Argument(metavar="NODE", help="A node trainmedic drained.")],
    comment: Annotated[str, typer.Option(help="What was fixed.")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
) -> None:
    """Return a node trainmedic drained to service (refused for nodes drained by someone else)."""
    check_node_name(node)  # a forged name never reaches the API's URL: exit 2 naming it, escaped
    r = api(
        data_dir,
        api_url,
        "POST",
        f"/api/nodes/{node}/resume",
        {"operator": operator or whoami(), "comment": comment},
    )
    typer.echo(printable(f"resumed {node} (it was drained for {r['incident_id']}): {r.get('check', '')}"))
