-- trainmedic audit trail, version 12: the incident's `isolate` fact (the fault lives on
-- the culprit's node), which policy's action follows since incidents carry no action.
-- `policy replay` and `policy explain` read it back; rows from before it are NULL and
-- their recommended_action (or decision) says it. Type as declared in sinks/audit_schema.py;
-- an added column is metadata-only.

ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS isolate Nullable(Bool) AFTER recommended_action;
