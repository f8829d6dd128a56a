"""`trainmedic topics ...`: the topics trainmedic needs, created once per Kafka (the chart's Job,
the bare-metal one-shot unit), and a look at what they hold (`list`, `tail`) with the project's own
Kafka client: Debian 12's kcat cannot talk to the embedded broker (docs/operating.md)."""

from __future__ import annotations

import base64
import json
import os
import sys
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Optional

import orjson
import typer

from schemas.errors import ConfigError, Unavailable, UsageError
from schemas.masking import mask
from schemas.printable import printable
from schemas.topics import DEFAULT_PARTITIONS
from trainmedic.cli.base import new_app, settings

topics_app = new_app(help="Create trainmedic's Kafka topics, list them, and print what they hold.")


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


# --- looking at the topics: `topics list` and `topics tail`, through bus/ (confluent-kafka) ----------------

DataDirOpt = Annotated[
    Path, typer.Option("--data-dir", help="Where a local `trainmedic up` keeps runtime.json (its broker's address).")
]
BootstrapOpt = Annotated[
    Optional[str],
    typer.Option(
        help="Kafka bootstrap servers HOST:PORT[,...] (default: the setting bootstrap, else the broker of the "
        "`trainmedic up` running on --data-dir)."
    ),
]


class UnknownTopic(UsageError, LookupError):
    """The topic is not on the broker: reading it would have a broker create it (the embedded one does)."""


class TopicsReadError(Unavailable, RuntimeError):
    """The Kafka client gave up reading a topic (a fatal client error)."""


def _find_bootstrap(flag: str | None, data_dir: Path) -> str:
    """The setting first (a site's Kafka), else the embedded broker of a local `up`, which picks its port at
    start and writes it to runtime.json: a first look at the topics needs no address."""
    from bus.admin import check_bootstrap

    bootstrap = settings(bootstrap=flag).bootstrap
    if not bootstrap:
        runtime = data_dir / "runtime.json"
        try:
            bootstrap = str(json.loads(runtime.read_text())["bootstrap"])
        except (OSError, ValueError, KeyError):
            raise ConfigError(
                "no Kafka given (--bootstrap, TRAINMEDIC_BOOTSTRAP or `bootstrap` in the config file) and no "
                f"running `trainmedic up` found in {data_dir} ({runtime} missing)"
            ) from None
    check_bootstrap(bootstrap)
    return bootstrap


def _topic_partitions(bootstrap: str) -> dict[str, list[int]]:
    """Every topic on the broker with its partitions. Listed without naming a topic: a metadata request
    for a missing one makes the embedded broker create it (docs/environment.md)."""
    from confluent_kafka.admin import AdminClient

    from bus.admin import TopicsUnavailable
    from bus.config import admin_config

    try:
        meta = AdminClient(admin_config(bootstrap)).list_topics(timeout=10).topics
    except Exception as exc:  # confluent_kafka raises KafkaException with a cause
        raise TopicsUnavailable(f"cannot list the topics at {bootstrap}: {exc}") from None
    return {name: sorted(t.partitions) for name, t in meta.items() if t.error is None}


def _end_offsets(bootstrap: str, topics: Iterable[str]) -> dict[tuple[str, int], int]:
    """Each partition's end offset, as a fetch answers it: the embedded broker's ListOffsets answer is short
    by up to one batch (bus.consume.fetched_end_offsets)."""
    from bus.admin import end_offsets
    from bus.consume import fetched_end_offsets

    wanted = set(topics)
    listed = {tp: end for tp, end in end_offsets(bootstrap).items() if tp[0] in wanted}
    return fetched_end_offsets(bootstrap, listed)


def _json_line(record: dict[str, Any]) -> str:
    """One JSON line that is safe on a terminal: every non-ASCII character and DEL escaped as JSON's
    \\uXXXX, so a record's ESC, CSI or bidi override reaches no terminal raw (what schemas.printable does
    for plain text) and the line stays JSON; then the secrets this process knows masked (schemas.masking)."""
    return mask(json.dumps(record, ensure_ascii=True).replace("\x7f", "\\u007f"))


def _value(raw: bytes | None) -> dict[str, Any]:
    if raw is None:
        return {"value": None}
    try:
        return {"value": orjson.loads(raw)}
    except orjson.JSONDecodeError:
        pass
    try:
        return {"value_text": raw.decode()}
    except UnicodeDecodeError:
        return {"value_base64": base64.b64encode(raw).decode()}


def record_json(msg: Any) -> dict[str, Any]:
    """A consumed record as `topics tail` prints it: where it is, its key, the broker's time (ISO 8601,
    UTC), its headers as text and its value, parsed where it is JSON (every trainmedic event is)."""
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

    ts_type, ts_ms = msg.timestamp()
    at = (
        datetime.fromtimestamp(ts_ms / 1000, UTC).isoformat(timespec="milliseconds")
        if ts_type != TIMESTAMP_NOT_AVAILABLE and ts_ms >= 0
        else None
    )
    key = msg.key()
    out: dict[str, Any] = {
        "topic": msg.topic(),
        "partition": msg.partition(),
        "offset": msg.offset(),
        "key": None if key is None else key.decode(errors="replace"),
        "timestamp": at,
    }
    if headers := msg.headers():
        out["headers"] = {name: None if v is None else v.decode(errors="replace") for name, v in headers}
    return out | _value(msg.value())


@topics_app.command("list")
def list_topics(
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON: each topic's partitions and end offsets.")
    ] = False,
) -> None:
    """Every topic on the broker, its partition count and end offsets.

    An end offset is the next offset its partition will write; offsets start at 0.
    Their total is the records written, less any that retention removed."""
    address = _find_bootstrap(bootstrap, data_dir)
    topics = _topic_partitions(address)
    ends = _end_offsets(address, topics)
    offsets = {name: {p: ends.get((name, p), 0) for p in partitions} for name, partitions in sorted(topics.items())}
    if as_json:
        typer.echo(json.dumps([{"topic": name, "end_offsets": ends} for name, ends in offsets.items()], indent=2))
        return
    for name, by_partition in offsets.items():
        filled = ", ".join(f"p{p} {end}" for p, end in by_partition.items() if end)
        typer.echo(
            printable(
                f"{name:<32} partitions {len(by_partition):>3}  end offsets total {sum(by_partition.values()):>8}"
                + (f"  ({filled})" if filled else "")
            )
        )


@topics_app.command("tail")
def tail(
    topic: Annotated[str, typer.Argument(help="The topic to read (`trainmedic topics list` names them).")],
    from_beginning: Annotated[
        bool, typer.Option("--from-beginning", help="Start at each partition's first record, not at its end.")
    ] = False,
    count: Annotated[
        Optional[int], typer.Option("--count", min=1, help="Stop after printing this many records.")
    ] = None,
    key: Annotated[
        Optional[str], typer.Option("--key", help="Only records with this key (a job id, a node name).")
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow/--no-follow", help="Wait for new records (Ctrl-C stops), or stop at the end."),
    ] = True,
    bootstrap: BootstrapOpt = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Print a topic's records as they come, one JSON object a line.

    Fields: topic, partition, offset, key, timestamp (the broker's, ISO 8601 in UTC), headers, value.
    It joins no consumer group and commits nothing: trainmedic's own consumers miss no record.
    What it is doing goes to stderr, the records to stdout."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

    from bus.consume import group_consumer

    address = _find_bootstrap(bootstrap, data_dir)
    topics = _topic_partitions(address)
    if topic not in topics:
        raise UnknownTopic(f"no topic {topic!r} on {address}; there are: {', '.join(sorted(topics)) or 'none'}")
    partitions = topics[topic]
    if from_beginning:
        starts = dict.fromkeys(partitions, OFFSET_BEGINNING)
    else:
        # Positioned at the ends a fetch reports: "latest" on the embedded broker is the start of the
        # last batch, which would print records written before the tail began (docs/environment.md).
        ends = _end_offsets(address, [topic])
        starts = {p: ends.get((topic, p), 0) for p in partitions}
    # Assigned, not subscribed: no group join (seconds on the embedded broker) and nothing committed.
    consumer = group_consumer(
        address,
        f"trainmedic-tail-{uuid.uuid4().hex[:8]}",
        "trainmedic-tail",
        background=True,
        **{"enable.partition.eof": True},
    )
    where = "from the beginning" if from_beginning else "from the end"
    typer.echo(
        printable(
            f"tailing {topic} on {address}: {len(partitions)} partitions {where}"
            + (f", key {key}" if key is not None else "")
            + (f", {count} records at most" if count else "")
            + ("" if follow else ", until the end")
        ),
        err=True,
    )
    wanted_key = None if key is None else key.encode()
    printed = 0
    at_end: set[int] = set()
    try:
        consumer.assign([TopicPartition(topic, p, offset) for p, offset in starts.items()])
        while count is None or printed < count:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if (err := msg.error()) is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition() or 0)
                    if not follow and at_end >= set(partitions):
                        break
                    continue
                if err.fatal():
                    raise TopicsReadError(f"reading {topic} at {address}: {err.str()}")
                continue  # transport errors are librdkafka's to retry
            if wanted_key is not None and msg.key() != wanted_key:
                continue
            sys.stdout.write(_json_line(record_json(msg)) + "\n")
            sys.stdout.flush()
            printed += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # `| head` closed the pipe: nothing more to print, and nothing to say at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        consumer.close()
