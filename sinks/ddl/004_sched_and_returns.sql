-- trainmedic audit trail, version 4: what the scheduler reported (drains and
-- cancels by people are how we learn what we missed), nodes returned to service
-- by operators, and refused mode changes (promotion gated by readiness).

CREATE TABLE IF NOT EXISTS {db}.sched_events (
    event_id String,
    event_time DateTime64(3, 'UTC'),
    kind LowCardinality(String),  -- 'job' or 'node'
    job_id Nullable(String),
    node Nullable(String),
    state LowCardinality(String),
    previous_state LowCardinality(Nullable(String)),
    nodes Array(String),
    partition Nullable(String),
    reason Nullable(String),
    flags Array(String)
) ENGINE = ReplacingMergeTree ORDER BY event_id;

CREATE TABLE IF NOT EXISTS {db}.node_returns (
    event_id String,
    event_time DateTime64(3, 'UTC'),
    node String,
    incident_id Nullable(String),
    drain_reason String,
    operator String,
    comment String
) ENGINE = ReplacingMergeTree ORDER BY event_id;

ALTER TABLE {db}.mode_changes ADD COLUMN IF NOT EXISTS outcome LowCardinality(String) DEFAULT 'applied';

ALTER TABLE {db}.mode_changes ADD COLUMN IF NOT EXISTS readiness String DEFAULT '';
