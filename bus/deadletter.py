"""Dead letters: how every consumer records a record it could not accept.

One constructor, so the streams, the executor and the audit sink say it the same
way. The id names the component and the record's position, so a record refused
by two components is two dead letters, and a redelivered refusal is one.
"""

from __future__ import annotations

import base64
import time

from schemas.events import DeadLetter
from schemas.ids import stable_id

# Whatever the original size, a dead letter must fit in one Kafka record (1 MB by default).
MAX_PAYLOAD_BYTES = 64 * 1024


def make_dead_letter(
    component: str, topic: str, partition: int | None, offset: int | None, reason: str, payload: bytes | None
) -> DeadLetter:
    raw = payload or b""
    if len(raw) > MAX_PAYLOAD_BYTES:
        reason = f"{reason} (payload cut to its first {MAX_PAYLOAD_BYTES} of {len(raw)} bytes)"
        raw = raw[:MAX_PAYLOAD_BYTES]
    return DeadLetter(
        event_id=stable_id("dlq", component, topic, partition, offset),
        event_time=time.time(),
        component=component,
        original_topic=topic,
        original_partition=partition,
        original_offset=offset,
        reason=reason[:2000],
        payload_b64=base64.b64encode(raw).decode(),
    )
