-- trainmedic audit trail, version 17: node returns record the health check run before each
-- resume and the returns that were refused (a lemon node, a failed or missing check), so the
-- audit says why a drained node stayed out of service. Types as declared in
-- sinks/audit_schema.py; added columns are metadata-only (old rows: resumed, no check).

ALTER TABLE {db}.node_returns ADD COLUMN IF NOT EXISTS outcome LowCardinality(String) DEFAULT 'resumed' AFTER comment;
ALTER TABLE {db}.node_returns ADD COLUMN IF NOT EXISTS check Nullable(String) AFTER outcome;
ALTER TABLE {db}.node_returns ADD COLUMN IF NOT EXISTS check_passed Nullable(Bool) AFTER check;
ALTER TABLE {db}.node_returns ADD COLUMN IF NOT EXISTS detail String DEFAULT '' AFTER check_passed;
