-- trainmedic audit trail, version 14: the job's Comment on its incident (where the job's owner
-- writes trainmedic=off|monitor|restarts=N, streams/policy.py JobSettings), so that
-- `policy explain` and `policy replay` see the setting the decision followed; and the `drain`
-- action (the node only, the job left alone, for a job whose owner said trainmedic=off) counted
-- as a drain by repeat_offenders. Type as declared in sinks/audit_schema.py; an added column
-- is metadata-only.

ALTER TABLE {db}.incidents ADD COLUMN IF NOT EXISTS job_comment Nullable(String) AFTER account;

CREATE OR REPLACE VIEW {db}.repeat_offenders AS
SELECT
    assumeNotNull(culprit_node) AS node,
    count() AS incidents,
    min(detected_at) AS first_seen,
    max(detected_at) AS last_seen,
    arraySort(groupUniqArray(toString(category))) AS categories,
    uniqExact(job_id) AS jobs_hit,
    countIf(decision_action IN ('drain', 'drain_and_requeue') AND actions_done > 0) AS drains
FROM {db}.incident_summary
WHERE culprit_node IS NOT NULL
GROUP BY node
ORDER BY incidents DESC, last_seen DESC;
