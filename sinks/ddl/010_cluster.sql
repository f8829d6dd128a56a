-- trainmedic audit trail, version 10: the cluster each row is about (the settings' cluster
-- name, in every event since schema version 2), so several Slurm clusters can share one
-- ClickHouse. Rows written before it belong to the default cluster. Type as declared in
-- sinks/audit_schema.py (CLUSTER_COLUMN); an added column is metadata-only (no rewrite).

ALTER TABLE {db}.anomalies ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.decisions ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.actions ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.action_results ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.action_attempts ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.approvals ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.mode_changes ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.node_returns ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.guardrail_trips ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
ALTER TABLE {db}.dead_letters ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT 'default';
