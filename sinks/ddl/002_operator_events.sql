-- trainmedic audit trail, version 2: operator verdicts, autonomy switches and
-- guardrail trips. Same conventions as 001: ReplacingMergeTree keyed by the
-- event's own id, so a redelivered event replaces its row (query with FINAL).
-- These events carry no latency timestamps of their own; views join them to
-- their incident (incident_id) for first_signal_time and detection time.

CREATE TABLE IF NOT EXISTS {db}.approvals (
    approval_id String,
    event_time DateTime64(3, 'UTC'),  -- when the operator gave the verdict
    decision_id String,
    incident_id String,
    job_id Nullable(String),
    partition Nullable(String),
    category LowCardinality(String),
    action LowCardinality(String),
    verdict LowCardinality(String),  -- 'approved' or 'rejected'
    reason LowCardinality(Nullable(String)),  -- why rejected: a fixed list (schemas/vocab.py RejectReason)
    comment String,
    operator String
) ENGINE = ReplacingMergeTree ORDER BY approval_id;

CREATE TABLE IF NOT EXISTS {db}.mode_changes (
    event_id String,
    event_time DateTime64(3, 'UTC'),
    partition Nullable(String),  -- NULL: the default for every partition
    category LowCardinality(Nullable(String)),  -- NULL: every category
    old_mode LowCardinality(Nullable(String)),
    new_mode LowCardinality(String),
    operator String,
    reason String,
    forced Bool
) ENGINE = ReplacingMergeTree ORDER BY event_id;

CREATE TABLE IF NOT EXISTS {db}.guardrail_trips (
    event_id String,
    event_time DateTime64(3, 'UTC'),  -- when the executor refused the action
    guardrail LowCardinality(String),
    action_id String,
    incident_id String,
    job_id Nullable(String),
    node Nullable(String),
    partition Nullable(String),
    action LowCardinality(String),
    detail String
) ENGINE = ReplacingMergeTree ORDER BY event_id;
