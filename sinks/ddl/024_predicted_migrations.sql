-- trainmedic audit trail, version 24: predictions (issue 44). Every incident says its kind:
-- reactive (a fault that happened; every row from before this migration) or predicted (a
-- pre-failure verdict about a GPU of one of the job's nodes, streams/migration.py). Checkpoint-
-- aligned migrations (topic migrations): one row per state of each (waiting, requeued, fell_back,
-- superseded, ended, cancelled); the latest row of a migration is where it stands. Record
-- retention, like the incidents. The column is metadata-only; the runner creates the table from
-- its declaration in sinks/audit_schema.py (the layout of 007).
-- rebuild: migrations

ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS kind LowCardinality(String) DEFAULT 'reactive' AFTER domain_failed_nodes;
