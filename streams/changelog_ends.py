"""Where Faust's table recovery stops reading a changelog: the end offset a fetch reports.

Faust recovers a table by reading its changelog partitions up to their "highwater", which it
asks the broker for with ListOffsets (aiokafka's `end_offsets`). The embedded broker answers that
with the first offset of the partition's last batch + 1 (docs/environment.md). Recovery then
stopped early and paused the partition, and the rest of the last batch was never read. Measured with a
Faust table recovering from a changelog written in batches: 5+5+5 records recovered 11, one
batch of 15 recovered 1. The worker's producer lingers (streams/app.py), so its changelog writes
come in batches of several records. This patch fixes the highwaters with
`bus.consume.fetched_end_offsets`, which reads each partition's last batch; on Kafka the two
answers agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread  # type: ignore[attr-defined]

from bus.consume import fetched_end_offsets

_FIXED = "_trainmedic_fixed"


def fix_highwaters(bootstrap: str) -> None:
    """Faust's consumer answers its table recovery's highwater requests with fetched end offsets."""
    original = getattr(AIOKafkaConsumerThread.highwaters, _FIXED, AIOKafkaConsumerThread.highwaters)

    async def highwaters(self: Any, *partitions: Any) -> Mapping[Any, int]:
        # Keyed by aiokafka's TopicPartition, a (topic, partition) named tuple; None where it cannot tell.
        listed: Mapping[Any, int] = await original(self, *partitions)
        known = {tp: end for tp, end in listed.items() if end is not None}
        ends = await asyncio.get_running_loop().run_in_executor(None, fetched_end_offsets, bootstrap, known)
        return {**listed, **ends}

    setattr(highwaters, _FIXED, original)
    AIOKafkaConsumerThread.highwaters = highwaters  # type: ignore[method-assign]
