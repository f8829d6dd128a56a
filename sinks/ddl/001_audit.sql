-- trainmedic audit trail, version 1. `{db}` is replaced by the database name.
-- ReplacingMergeTree keyed by the event id: a redelivered event replaces its
-- own row instead of adding a duplicate (query with FINAL for exact counts).
CREATE DATABASE IF NOT EXISTS {db};

CREATE TABLE IF NOT EXISTS {db}.anomalies (
    event_id String,
    event_time DateTime64(3, 'UTC'),
    produced_at DateTime64(3, 'UTC'),
    detector LowCardinality(String),
    signature LowCardinality(String),
    category LowCardinality(String),
    severity LowCardinality(String),
    role LowCardinality(String),
    source LowCardinality(String),
    job_id Nullable(String),
    node Nullable(String),
    rank Nullable(Int32),
    partition Nullable(String),
    line String,
    meaning String
) ENGINE = ReplacingMergeTree ORDER BY event_id;

CREATE TABLE IF NOT EXISTS {db}.incidents (
    incident_id String,
    event_time DateTime64(3, 'UTC'),
    first_signal_time DateTime64(3, 'UTC'),
    job_id Nullable(String),
    partition Nullable(String),
    job_nodes Array(String),
    category LowCardinality(String),
    severity LowCardinality(String),
    culprit_node Nullable(String),
    culprit_rank Nullable(Int32),
    confidence Float32,
    recommended_action LowCardinality(String),
    explanation String,
    evidence String,  -- JSON list of {source, signature, node, rank, time, line, role}
    anomaly_ids Array(String),
    detection_latency_s Float64  -- first fault signal -> incident published
) ENGINE = ReplacingMergeTree ORDER BY incident_id;

CREATE TABLE IF NOT EXISTS {db}.decisions (
    decision_id String,
    event_time DateTime64(3, 'UTC'),
    incident_id String,
    job_id Nullable(String),
    partition Nullable(String),
    category LowCardinality(String),
    culprit_node Nullable(String),
    action LowCardinality(String),
    mode LowCardinality(String),
    kind LowCardinality(String),  -- 'action' or 'recommendation'
    rule String,
    reason String,
    first_signal_time DateTime64(3, 'UTC'),
    incident_time DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY decision_id;

CREATE TABLE IF NOT EXISTS {db}.actions (
    action_id String,
    event_time DateTime64(3, 'UTC'),
    decision_id String,
    incident_id String,
    job_id Nullable(String),
    node Nullable(String),
    partition Nullable(String),
    action LowCardinality(String),
    reason String,
    requested_by String,
    incident_time DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY action_id;

CREATE TABLE IF NOT EXISTS {db}.action_results (
    action_id String,
    event_time DateTime64(3, 'UTC'),
    incident_id String,
    job_id Nullable(String),
    node Nullable(String),
    action LowCardinality(String),
    status LowCardinality(String),
    backend LowCardinality(String),
    steps Array(String),
    error Nullable(String),
    started_at DateTime64(3, 'UTC'),
    verified_at Nullable(DateTime64(3, 'UTC')),
    incident_time DateTime64(3, 'UTC'),
    first_signal_time DateTime64(3, 'UTC'),
    action_latency_s Nullable(Float64)  -- incident published -> effect verified
) ENGINE = ReplacingMergeTree ORDER BY action_id;

CREATE TABLE IF NOT EXISTS {db}.dead_letters (
    event_id String,
    event_time DateTime64(3, 'UTC'),
    component LowCardinality(String),
    original_topic LowCardinality(String),
    original_partition Nullable(Int32),
    original_offset Nullable(Int64),
    reason String,
    payload_b64 String
) ENGINE = ReplacingMergeTree ORDER BY event_id;
