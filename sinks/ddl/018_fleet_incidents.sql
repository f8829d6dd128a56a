-- trainmedic audit trail, version 18: fleet incidents (streams/fleet.py) name the shared component
-- whose nodes failed together (a leaf switch of topology.conf, a rack) and all its nodes. NULL and
-- empty on a job's incident. Types as declared in sinks/audit_schema.py; metadata-only.

ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS domain Nullable(String) AFTER job_comment;
ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS domain_nodes Array(String) AFTER domain;
