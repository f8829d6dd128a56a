"""How the streams worker's Kafka consumer fetches: two settings Faust does not pass to aiokafka.

Both patch aiokafka at import of the streams app (the worker process only; producers and sinks
use confluent-kafka). aiokafka is pinned by faust-streaming; `pace_fetches` checks the method it
wraps is there and fails the worker's start with a clear error if an upgrade renamed it.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import aiokafka  # type: ignore[import-untyped]
from aiokafka.consumer.fetcher import Fetcher  # type: ignore[import-untyped]

_PACED = "_trainmedic_paced"


def cap_fetch_wait(max_wait_ms: int) -> None:
    """Faust hard-codes aiokafka's fetch_max_wait_ms=1500. A broker that does not answer a fetch
    as soon as data arrives then adds up to 1.5 s per hop, and a fault crosses three hops
    (signal -> anomaly -> incident -> decision). Cap it."""
    original = aiokafka.AIOKafkaConsumer.__init__

    def init(self: aiokafka.AIOKafkaConsumer, *args: Any, **kwargs: Any) -> None:
        kwargs["fetch_max_wait_ms"] = min(int(kwargs.get("fetch_max_wait_ms", 500)), max_wait_ms)
        original(self, *args, **kwargs)

    aiokafka.AIOKafkaConsumer.__init__ = init  # type: ignore[method-assign]


def pace_fetches(pace_s: float) -> None:
    """At most one fetch request per broker every `pace_s` seconds.

    aiokafka sends the next fetch as soon as the last one's records are handed over, and a broker
    with data answers at once (fetch_min_bytes is not honoured by every broker, the embedded one
    included). Under steady load the worker so fetched many times a second, a few records each,
    each request naming every assigned partition (12 partitions x a dozen topics): its largest
    socket cost and much of the broker's request handling. Waiting out the rest of the pace after
    the last answer makes each fetch carry more records; a record waits at most `pace_s` longer
    per hop. An idle consumer is not slowed as long as the pace is under fetch_max_wait_ms: its
    fetch waited that long at the broker already. 0 turns pacing off."""
    original = getattr(Fetcher, "_proc_fetch_request", None)
    original = getattr(original, _PACED, original)  # paced before (a second call): start from the original
    if pace_s <= 0:
        if original is not None:
            Fetcher._proc_fetch_request = original
        return
    if original is None or list(inspect.signature(original).parameters) != ["self", "assignment", "node_id", "request"]:
        raise RuntimeError(
            "aiokafka's Fetcher._proc_fetch_request(self, assignment, node_id, request) is not there: "
            "this aiokafka is not the one trainmedic was built for; set TRAINMEDIC_FETCH_PACE_MS=0 to run unpaced"
        )

    async def paced(self: Fetcher, assignment: Any, node_id: int, request: Any) -> bool:
        loop = asyncio.get_running_loop()
        answered: dict[int, float] = self.__dict__.setdefault("_trainmedic_answered_at", {})
        wait = answered.get(node_id, float("-inf")) + pace_s - loop.time()
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                # As aiokafka's own fetch task: close() and a lost assignment cancel it and then
                # await it, expecting "no new data", not the cancellation.
                return False
        try:
            return await original(self, assignment, node_id, request)  # type: ignore[no-any-return]
        finally:
            answered[node_id] = loop.time()

    setattr(paced, _PACED, original)
    Fetcher._proc_fetch_request = paced
