"""Where the streams worker's consumer resumes a partition it has not committed.

Faust hands the records aiokafka fetched to its agents only for partitions active at that moment
and drops the rest; it counts on seeking every partition back to its committed offset afterwards
(faust Consumer.perform_seek, at the end of each recovery, which calls aiokafka's
AIOKafkaConsumer.seek_to_committed). At a worker's start the two race: the fetcher thread reads
the stream partitions while the recovery on the main loop pauses them, and the whole fetch is
dropped. aiokafka's seek moves only partitions committed above 0, so a partition never committed
- every partition of a new consumer group - stays past records no agent saw. Seen in the
catch-up benchmark's 2-worker run (2026-12-06): one worker's first fetch, 315 to 370 gpu.samples
records on each of six partitions, dropped as the recovery paused them, and the drain waited
forever with aiokafka at the end of those partitions.

`rewind_uncommitted` makes that seek complete for the stream partitions: committed (0 included),
back to the committed offset; never committed, to where the consumer's auto_offset_reset says. A
record may be read twice (attribution and the audit are idempotent by id); none is skipped.
Table changelog partitions are left as aiokafka leaves them: the group never commits them and
Faust's recovery seeks them itself.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped]
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

_REWINDS = "_trainmedic_rewinds_uncommitted"


async def seek_to_committed_or_reset(
    consumer: AIOKafkaConsumer, changelogs: Collection[str] = ()
) -> dict[TopicPartition, int | None]:
    """Each assigned partition to its committed offset, or, never committed, to where the reset
    policy says (a changelog's: left where it is); the committed offsets (None where there is
    none), as aiokafka's own seek_to_committed returns them."""
    committed: dict[TopicPartition, int | None] = {}
    uncommitted: list[TopicPartition] = []
    for tp in sorted(consumer.assignment()):
        offset = await consumer.committed(tp)
        committed[tp] = offset
        if offset is not None:
            consumer.seek(tp, offset)
        elif tp.topic not in changelogs:
            uncommitted.append(tp)
    if uncommitted:
        reset = str(consumer._auto_offset_reset).lower()
        if reset == "earliest":
            await consumer.seek_to_beginning(*uncommitted)
        elif reset == "latest":
            await consumer.seek_to_end(*uncommitted)
        # "none": aiokafka raises on a partition without a position, as it would unpatched
    return committed


def rewind_uncommitted() -> None:
    """Patch Faust's aiokafka consumer thread to seek with `seek_to_committed_or_reset`."""
    # Its own method, not the abstract one of faust's ConsumerThread it overrides.
    current = vars(AIOKafkaConsumerThread).get("seek_to_committed")
    if current is None or not hasattr(AIOKafkaConsumerThread, "_ensure_consumer"):
        raise RuntimeError(
            "faust's AIOKafkaConsumerThread.seek_to_committed is not there: this faust-streaming is not "
            "the one trainmedic was built for"
        )
    if getattr(current, _REWINDS, False):
        return

    async def seek_to_committed(self: AIOKafkaConsumerThread) -> Any:
        changelogs = set(self.app.tables.changelog_topics)
        return await self.call_thread(seek_to_committed_or_reset, self._ensure_consumer(), changelogs)

    setattr(seek_to_committed, _REWINDS, True)
    AIOKafkaConsumerThread.seek_to_committed = seek_to_committed  # type: ignore[method-assign]
