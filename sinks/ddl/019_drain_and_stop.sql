-- trainmedic audit trail, version 19: the action `drain_and_stop` (the restart budget or the
-- no-progress limit stops a job whose node has a fault of its own: the node is still drained)
-- counts as a drain in repeat_offenders and as a stop in job_restarts.

CREATE OR REPLACE VIEW {db}.repeat_offenders AS
SELECT
    assumeNotNull(culprit_node) AS node,
    count() AS incidents,
    min(detected_at) AS first_seen,
    max(detected_at) AS last_seen,
    arraySort(groupUniqArray(toString(category))) AS categories,
    uniqExact(job_id) AS jobs_hit,
    countIf(decision_action IN ('drain', 'drain_and_requeue', 'drain_and_stop') AND actions_done > 0) AS drains
FROM {db}.incident_summary
WHERE culprit_node IS NOT NULL
GROUP BY node
ORDER BY incidents DESC, last_seen DESC;

CREATE OR REPLACE VIEW {db}.job_restarts AS
SELECT
    job_id,
    countIf(status = 'done' AND action IN ('requeue', 'drain_and_requeue')) AS restarts,
    countIf(status = 'done' AND action IN ('stop', 'drain_and_stop')) AS stops,
    countIf(status = 'failed') AS failed_actions,
    uniqExact(incident_id) AS incidents,
    maxIf(verified_at, status = 'done' AND action IN ('requeue', 'drain_and_requeue')) AS last_restart_at
FROM {db}.action_results FINAL
WHERE job_id != ''
GROUP BY job_id;
