"""`trainmedic migrations cancel`: stop a pending checkpoint-aligned migration, through the operator API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from schemas.printable import printable
from trainmedic.cli.base import ApiOpt, DataDir, OperatorOpt, api, new_app, whoami

migrations_app = new_app(help="Checkpoint-aligned migrations (pre-failure verdicts): cancel a pending one.")


@migrations_app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(metavar="JOBID", help="The job whose pending migration to cancel.")],
    comment: Annotated[str, typer.Option(help="Why (e.g. the prediction is wrong).")] = "",
    operator: OperatorOpt = "",
    data_dir: DataDir = Path("var"),
    api_url: ApiOpt = None,
) -> None:
    """Cancel a job's pending migration: the job is not requeued, the node it drained is resumed.
    `trainmedic audit job JOBID` shows the pending one."""
    r = api(
        data_dir,
        api_url,
        "POST",
        f"/api/migrations/{job_id}/cancel",
        {"operator": operator or whoami(), "comment": comment},
    )
    typer.echo(printable(f"cancelled {r['migration_id']} of job {job_id}: {r['detail']}"))
