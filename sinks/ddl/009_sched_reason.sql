-- trainmedic audit trail, version 9: a node event's reason author and time as Slurm
-- reports them, and the MAINT reservation holding the node (the Slurm producer has
-- sent them since the coexistence work): whose drain it was, and whether it was
-- planned maintenance, can be read back from the audit. Types as declared in
-- sinks/audit_schema.py; added columns are metadata-only in ClickHouse (no rewrite).

ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS reason_user LowCardinality(Nullable(String));
ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS reason_time Nullable(DateTime64(3, 'UTC'));
ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS reservation LowCardinality(Nullable(String));
