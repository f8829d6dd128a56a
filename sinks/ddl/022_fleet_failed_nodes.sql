-- trainmedic audit trail, version 22: a fleet incident names the nodes of its domain that failed
-- (their own incidents made it, and keep their drains), besides all the domain's nodes: a drain
-- set takes only the others. Empty on a job's incident. Types as declared in
-- sinks/audit_schema.py; metadata-only.

ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS domain_failed_nodes Array(String) AFTER domain_nodes;
