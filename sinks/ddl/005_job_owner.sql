-- trainmedic audit trail, version 5: who runs the job (name, user, account, from
-- the scheduler's job state), so that incidents can be searched by owner and a
-- replay evaluates policy rules that match on them.

ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS job_name Nullable(String);
ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS user Nullable(String);
ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS account Nullable(String);
ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS job_name Nullable(String);
ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS user Nullable(String);
ALTER TABLE {db}.sched_events ADD COLUMN IF NOT EXISTS account Nullable(String);
