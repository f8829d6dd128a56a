"""Kafka client settings every component shares (the one place librdkafka is configured).

Short session/heartbeat timeouts matter: a consumer group join takes about
half of `session.timeout.ms` on the embedded broker (docs/environment.md).

TLS and SASL are process-wide (`configure_security`, called once at start from the
settings model): every producer, consumer and admin client of the process gets them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

# librdkafka's own log lines go through Python logging instead of raw stderr.
_KAFKA_LOG = logging.getLogger("trainmedic.kafka")


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: str = "plaintext"  # plaintext | ssl | sasl_plaintext | sasl_ssl
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)  # never in a repr, a log line or a message
    ssl_ca: str | None = None
    ssl_certificate: str | None = None
    ssl_key: str | None = None

    def librdkafka(self) -> dict[str, Any]:
        """The librdkafka keys for this security setting (empty for plaintext)."""
        out: dict[str, Any] = {}
        if self.protocol != "plaintext":
            out["security.protocol"] = self.protocol
        if self.protocol.startswith("sasl"):
            if not (self.sasl_mechanism and self.sasl_username and self.sasl_password):
                raise ValueError(f"Kafka {self.protocol} needs a SASL mechanism, username and password")
            out |= {
                "sasl.mechanism": self.sasl_mechanism,
                "sasl.username": self.sasl_username,
                "sasl.password": self.sasl_password,
            }
        for key, value in (
            ("ssl.ca.location", self.ssl_ca),
            ("ssl.certificate.location", self.ssl_certificate),
            ("ssl.key.location", self.ssl_key),
        ):
            if value:
                out[key] = value
        return out


_security = KafkaSecurity()
# Kafka's own floor (group.min.session.timeout.ms) is 6000 by default; the embedded broker has none.
DEFAULT_SESSION_TIMEOUT_MS = 6000
_session_timeout_ms = DEFAULT_SESSION_TIMEOUT_MS


def configure_session_timeout(ms: int) -> None:
    """The consumer-group session timeout of every consumer of the process (and the Faust worker's)."""
    global _session_timeout_ms
    if ms < 1500:
        raise ValueError(f"session timeout {ms} ms: at least 1500 (three heartbeats of 500 ms)")
    _session_timeout_ms = ms


def session_timeout_ms() -> int:
    return _session_timeout_ms


def heartbeat_interval_ms() -> int:
    """A third of the session timeout, at most 1 s: three heartbeats may be missed before eviction."""
    return min(1000, _session_timeout_ms // 3)


def configure_security(security: KafkaSecurity) -> None:
    global _security
    security.librdkafka()  # refuse an incomplete setting now, not at the first connection
    _security = security


def security() -> KafkaSecurity:
    return _security


def producer_config(bootstrap: str, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "logger": _KAFKA_LOG,
        **_security.librdkafka(),
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


# How long the embedded broker holds a fetch. Tansu (0.6) answers a fetch only when its wait
# expires, not when data arrives, and reads every partition of the request again while it waits:
# a short wait bounds the latency a hop adds, but each consumer's fetch loop costs the broker CPU
# in proportion to its partitions, with or without data (docs/environment.md: all consumers at
# 100 ms kept an idle embedded broker at 50 % of a core). So the consumers on a fault's path wait
# briefly and those that only record or follow wait longer.
PROMPT_FETCH_WAIT_MS = 100
BACKGROUND_FETCH_WAIT_MS = 500


def consumer_config(bootstrap: str, group: str, client_id: str, *, background: bool = False) -> dict[str, Any]:
    """`background`: a consumer no decision waits on (the audit, followers, the console)."""
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "client.id": client_id,
        "logger": _KAFKA_LOG,
        **_security.librdkafka(),
        # The embedded broker answers "latest" wrongly; committed offsets plus
        # earliest are exact.
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": _session_timeout_ms,
        "heartbeat.interval.ms": heartbeat_interval_ms(),
        "max.poll.interval.ms": 300_000,
        "fetch.wait.max.ms": BACKGROUND_FETCH_WAIT_MS if background else PROMPT_FETCH_WAIT_MS,
    }


def admin_config(bootstrap: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "logger": _KAFKA_LOG, **_security.librdkafka()}
