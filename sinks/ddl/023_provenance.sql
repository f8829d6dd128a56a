-- trainmedic audit trail, version 23: who could have written each piece of evidence (its
-- provenance: kernel, kernel_file, gpu, net, scheduler, service, job; schemas/vocab.py), on every
-- anomaly and, as the strongest among the deciding evidence, on every incident. An incident's
-- evidence JSON carries each item's own. Rows from before it are NULL (their `source` says
-- where the evidence came from). Types as declared in sinks/audit_schema.py; metadata-only.

ALTER TABLE {db}.anomalies ADD COLUMN IF NOT EXISTS provenance LowCardinality(Nullable(String)) AFTER source;
ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS provenance LowCardinality(Nullable(String)) AFTER isolate;
