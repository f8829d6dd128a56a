"""`trainmedic topics acls`: the Kafka ACLs of one principal per component (bus/acls.py).

Registered on the `topics` noun from main.py; the matrix itself is data in bus/acls.py.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Optional

import typer
import yaml

from bus import acls


class AclFormat(StrEnum):
    kafka_acls = "kafka-acls"
    strimzi = "strimzi"
    table = "table"
    json = "json"


def acls_cmd(
    fmt: Annotated[
        AclFormat,
        typer.Option(
            "--format",
            help="kafka-acls: kafka-acls.sh commands (for a shell with BOOTSTRAP and ADMIN_CONFIG set); "
            "strimzi: KafkaUser objects (SCRAM-SHA-512); table: the matrix as docs/security.md shows it; "
            "json: the matrix as data.",
        ),
    ] = AclFormat.kafka_acls,
    principal: Annotated[
        str,
        typer.Option(
            help="The principal naming scheme; {component} is replaced by each component's name "
            "(gpu, kernel, ib, logs, node-agent, slurm-producer, ingest, streams, executor, audit-sink, api, "
            "notifier, topics)."
        ),
    ] = acls.DEFAULT_PRINCIPAL,
    component: Annotated[
        Optional[list[str]],
        typer.Option(help="Only this component (repeatable); default: every one with Kafka access."),
    ] = None,
    bootstrap: Annotated[
        str, typer.Option(help="What kafka-acls.sh gets as --bootstrap-server (default: the shell's $BOOTSTRAP).")
    ] = "$BOOTSTRAP",
    streams_id: Annotated[
        str,
        typer.Option(
            help="The streams workers' setting streams_id: their consumer group and the prefix of their own "
            "topics (the Helm chart's is RELEASE-trainmedic-streams, e.g. tm-trainmedic-streams)."
        ),
    ] = acls.STREAMS_ID,
    strimzi_cluster: Annotated[
        str, typer.Option(help="The Strimzi Kafka cluster the KafkaUsers belong to (label strimzi.io/cluster).")
    ] = "kafka",
) -> None:
    """Print the Kafka ACLs that give each component its own principal and only the topics and groups it uses."""
    if fmt is AclFormat.table:
        typer.echo(acls.markdown_table())
    elif fmt is AclFormat.json:
        typer.echo(acls.as_json())
    elif fmt is AclFormat.strimzi:
        typer.echo(
            yaml.safe_dump_all(acls.strimzi_users(principal, component, strimzi_cluster, streams_id), sort_keys=False)
        )
    else:
        typer.echo("\n".join(acls.kafka_acls_commands(principal, component, bootstrap, streams_id)))
