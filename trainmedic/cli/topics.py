"""`trainmedic topics ...`: the topics trainmedic needs, created once per Kafka (the chart's Job,
the bare-metal one-shot unit)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from schemas.errors import ConfigError
from schemas.topics import DEFAULT_PARTITIONS
from trainmedic.cli.base import new_app, settings

topics_app = new_app(help="Create and check trainmedic's Kafka topics.")


@topics_app.command("create")
def create(
    bootstrap: Annotated[
        Optional[str], typer.Option(help="Kafka bootstrap servers HOST:PORT[,...] (default: the setting bootstrap).")
    ] = None,
    partitions: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="Partitions per topic, fixed for the topics' life: keys hash onto them, so growing one later "
            "splits a job's events across partitions (default: the setting topic_partitions, "
            f"{DEFAULT_PARTITIONS}).",
        ),
    ] = None,
    retention_hours: Annotated[
        Optional[float],
        typer.Option(help="Retention of the event topics (default: the setting topic_retention_hours; >= 24)."),
    ] = None,
) -> None:
    """Create every topic that is missing (mode.changes kept for ever); idempotent.

    Exit 0 when all exist with the partition count; 2 when one exists with another count."""
    from bus.admin import ensure_topics
    from trainmedic.cli.run import _bootstrap

    s = settings(topic_retention_hours=retention_hours, topic_partitions=partitions)
    partitions = s.topic_partitions
    address = _bootstrap(bootstrap, "topics create")
    report = ensure_topics(address, partitions, retention_hours=s.topic_retention_hours)
    typer.echo(
        f"topics on {address}: created {len(report.created)} ({', '.join(report.created) or '-'}), "
        f"already there {len(report.existing)}; partitions {partitions}, retention {s.topic_retention_hours:g} h "
        "(mode.changes: kept for ever)"
    )
    if report.mismatched:
        raise ConfigError(
            "these topics exist with another partition count than "
            f"{partitions}: "
            + ", ".join(f"{name} ({count})" for name, count in sorted(report.mismatched.items()))
            + "; partitions cannot change under a running trainmedic (keys would move): recreate them empty, "
            "or give --partitions to match"
        )
