"""`trainmedic readiness`: is monitor mode good enough yet, per category and partition?

With a running `trainmedic up` (DATA_DIR/runtime.json) it goes through its operator
API, since that process owns the chDB folder; otherwise it opens the audit directly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from schemas.printable import printable
from streams.policy import load_overlay, load_policy
from trainmedic.cli.audit import ClickHouse, Database
from trainmedic.cli.base import AsJson, DataDir, running_api, since_days
from trainmedic.cli.client import call

#: trainmedic.ops.readiness.PREDICTED_PREFIX (not imported: the command reads the API's answer as well).
PREDICTED_PREFIX = "predicted: "


def readiness_cmd(
    since: Annotated[str, typer.Option(help="History to score: 30d, 7d, 24h.")] = "30d",
    policy: Annotated[Optional[Path], typer.Option(help="Policy whose readiness thresholds apply.")] = None,
    data_dir: DataDir = Path("var"),
    clickhouse: ClickHouse = None,
    database: Database = "trainmedic",
    as_json: AsJson = False,
) -> None:
    """Per category and partition: recommendations, precision, misses, latency, and a verdict for autonomy."""
    days = since_days(since)
    api = running_api(data_dir, clickhouse)
    rows: list[dict[str, Any]]
    if api is not None:
        rows = call(api[0], api[1], "GET", f"/api/readiness?since_days={days}")
    else:
        from trainmedic.cli.audit import open_store
        from trainmedic.ops.readiness import readiness

        pol = load_policy(policy).with_overlay(load_overlay(data_dir / "modes.yaml"))
        store = open_store(data_dir, clickhouse, database)
        try:
            rows = [s.as_dict() for s in readiness(store, pol, since_s=time.time() - days * 86400)]
        finally:
            store.close()
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    predictions = [r for r in rows if r["category"].startswith(PREDICTED_PREFIX)]
    rows = [r for r in rows if not r["category"].startswith(PREDICTED_PREFIX)]
    typer.echo(
        f"{'category':13} {'partition':10} {'recs':>5} {'appr':>5} {'rej':>4} {'conf':>5} {'exp':>4} "
        f"{'prec':>5} {'miss':>5} {'det p50':>8} {'act p50':>8}  verdict"
    )
    for r in rows:
        prec = "-" if r["precision"] is None else f"{r['precision']:.0%}"
        det = "-" if r["detection_p50_s"] is None else f"{r['detection_p50_s']:.1f}s"
        act = "-" if r["action_p50_s"] is None else f"{r['action_p50_s']:.1f}s"
        why = f" ({'; '.join(r['missing'])})" if r["missing"] else ""
        line = (
            f"{r['category']:13} {r['partition'] or '*':10} {r['recommendations']:5} {r['approved']:5} "
            f"{r['rejected']:4} {r['confirmed']:5} {r['expired']:4} {prec:>5} {r['misses']:5} {det:>8} "
            f"{act:>8}  {r['verdict']}{why}"
        )
        typer.echo(printable(line))
    if predictions:
        _print_predictions(predictions)


def _print_predictions(rows: list[dict[str, Any]]) -> None:
    """Predictions per pre-failure rule, scored by the facts (docs/prediction.md, "Precision")."""
    typer.echo("")
    typer.echo(f"{'predicted (rule)':28} {'preds':>5} {'true':>5} {'false':>5} {'pend':>5} {'prec':>5}  verdict; why")
    for r in rows:
        prec = "-" if r["precision"] is None else f"{r['precision']:.0%}"
        why = f" ({'; '.join(r['missing'])})" if r["missing"] else ""
        bases = ", ".join(f"{n} {b}" for b, n in sorted(r["bases"].items()))
        line = (
            f"{r['category'].removeprefix(PREDICTED_PREFIX):28} {r['recommendations']:5} {r['confirmed']:5} "
            f"{r['refuted']:5} {r['open']:5} {prec:>5}  {r['verdict']}{why}; {bases}"
        )
        typer.echo(printable(line))
