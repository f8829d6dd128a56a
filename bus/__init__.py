"""The one way to publish and consume (Kafka), beside `schemas/` (which holds data only).

- Settings of every Kafka client: `bus.config`.
- Publishing an event: `bus.publish.Publisher.publish(topic, event)` from threads and
  processes (producers, executor, API), or, in the Faust streams worker, an async send of
  the parts `bus.publish.prepare(topic, event, limit)` returns. Either way every publish
  is checked against the topic's event type, keyed by the topic's rule
  (`schemas.topics.partition_key`), made to fit the message limit (`bus.fit`), counted,
  and what cannot be sent becomes a dead letter (`bus.deadletter`).
- Consuming: `bus.consume.group_consumer` (a consumer group with the shared settings) and
  `bus.consume.read_records` (read a topic's recent records back after a restart).
"""
