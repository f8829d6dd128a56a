"""Kafka client settings every component shares (the one place librdkafka is configured).

Short session/heartbeat timeouts matter: a consumer group join takes about
half of `session.timeout.ms` on the embedded broker (see ENVIRONMENT-NOTES).
"""

from __future__ import annotations

import logging
from typing import Any

# librdkafka's own log lines go through Python logging instead of raw stderr.
_KAFKA_LOG = logging.getLogger("trainmedic.kafka")


def producer_config(bootstrap: str, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "logger": _KAFKA_LOG,
        "acks": "all",
        "linger.ms": 5,
        # No compression: Faust's aiokafka reads lz4/zstd only with extra codec
        # libraries; an unreadable batch would crash the streams worker.
        "compression.type": "none",
        # Faust (aiokafka) partitions keys with murmur2; match it so keyed data
        # from our producers lands where Faust expects it.
        "partitioner": "murmur2_random",
        "message.timeout.ms": 300_000,
        "queue.buffering.max.messages": 100_000,
    }


def consumer_config(bootstrap: str, group: str, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "client.id": client_id,
        "logger": _KAFKA_LOG,
        # The embedded broker answers "latest" wrongly; committed offsets plus
        # earliest are exact.
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 300_000,
        # The embedded broker answers a fetch only when its wait expires, not when
        # data arrives: a short wait bounds the latency each hop adds.
        "fetch.wait.max.ms": 100,
    }


def admin_config(bootstrap: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "logger": _KAFKA_LOG}
