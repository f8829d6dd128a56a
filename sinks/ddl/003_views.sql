-- trainmedic audit trail, version 3: reporting views.
--
-- Plain views over FINAL, not materialized views: a materialized view sees
-- each inserted block once, before ReplacingMergeTree has merged away a
-- redelivered event, so its counts would drift above the truth. Audit volumes
-- (incidents, not log lines) keep FINAL cheap. Every view reads its tables
-- with FINAL, so every number here is exact under redelivery.
--
-- Latencies, all in seconds:
--   detection_latency_s  first fault signal -> incident published   (incidents)
--   action_latency_s     incident published -> action verified      (action_results)
--   recovery_s           first fault signal -> action verified      (= detection + action)

-- One row per incident, with what policy, operators and the executor made of it.
CREATE OR REPLACE VIEW {db}.incident_summary AS
SELECT
    i.incident_id AS incident_id,
    i.event_time AS detected_at,
    i.first_signal_time AS first_signal_time,
    i.job_id AS job_id,
    i.partition AS partition,
    i.job_nodes AS job_nodes,
    toUInt32(length(i.job_nodes)) AS job_node_count,
    i.category AS category,
    i.severity AS severity,
    i.culprit_node AS culprit_node,
    i.confidence AS confidence,
    i.recommended_action AS recommended_action,
    i.detection_latency_s AS detection_latency_s,
    d.decision_kind AS decision_kind,
    d.decision_action AS decision_action,
    d.decision_mode AS decision_mode,
    ap.verdict AS verdict,
    ap.verdict_at AS verdict_at,
    ap.operator AS operator,
    r.actions AS actions,
    r.actions_done AS actions_done,
    r.actions_failed AS actions_failed,
    r.verified_at AS verified_at,
    r.action_latency_s AS action_latency_s,
    if(r.verified_at IS NULL, NULL,
       (toUnixTimestamp64Milli(assumeNotNull(r.verified_at)) - toUnixTimestamp64Milli(i.first_signal_time)) / 1000.0
    ) AS recovery_s,
    g.guardrail_trips AS guardrail_trips
FROM {db}.incidents AS i FINAL
LEFT JOIN (
    SELECT
        incident_id,
        argMax(kind, event_time) AS decision_kind,
        argMax(action, event_time) AS decision_action,
        argMax(mode, event_time) AS decision_mode
    FROM {db}.decisions FINAL
    GROUP BY incident_id
) AS d ON d.incident_id = i.incident_id
LEFT JOIN (
    SELECT
        incident_id,
        argMax(verdict, event_time) AS verdict,
        max(event_time) AS verdict_at,
        argMax(operator, event_time) AS operator
    FROM {db}.approvals FINAL
    GROUP BY incident_id
) AS ap ON ap.incident_id = i.incident_id
LEFT JOIN (
    SELECT
        incident_id,
        count() AS actions,
        countIf(status = 'done') AS actions_done,
        countIf(status = 'failed') AS actions_failed,
        -- the first verified effect ends the outage, whatever came after it
        minIf(verified_at, status = 'done') AS verified_at,
        minIf(action_latency_s, status = 'done') AS action_latency_s
    FROM {db}.action_results FINAL
    GROUP BY incident_id
) AS r ON r.incident_id = i.incident_id
LEFT JOIN (
    SELECT incident_id, count() AS guardrail_trips FROM {db}.guardrail_trips FINAL GROUP BY incident_id
) AS g ON g.incident_id = i.incident_id;

-- Incidents per day and category.
CREATE OR REPLACE VIEW {db}.incidents_daily AS
SELECT
    toDate(event_time) AS day,
    category,
    count() AS incidents,
    uniqExact(job_id) AS jobs,
    uniqExact(culprit_node) AS culprit_nodes
FROM {db}.incidents FINAL
GROUP BY day, category;

-- p50/p95/p99 of detection, action and recovery latency: one row 'all', then one per category.
-- quantileExactInclusive: exact, interpolated between neighbours (numpy's default "linear" method).
-- Action and recovery percentiles cover incidents with a verified action only (NULL when none).
-- UNION ALL rather than GROUPING SETS: chDB 26.9 drops the total row of a
-- GROUPING SETS view when a query reads only some of its columns.
CREATE OR REPLACE VIEW {db}.latency_percentiles AS
SELECT category, incidents, detection_p50, detection_p95, detection_p99,
       actions_verified, action_p50, action_p95, action_p99, recovery_p50, recovery_p95, recovery_p99
FROM (
    SELECT
        'all' AS category,
        0 AS is_category,
        count() AS incidents,
        quantileExactInclusive(0.5)(detection_latency_s) AS detection_p50,
        quantileExactInclusive(0.95)(detection_latency_s) AS detection_p95,
        quantileExactInclusive(0.99)(detection_latency_s) AS detection_p99,
        count(action_latency_s) AS actions_verified,
        quantileExactInclusive(0.5)(action_latency_s) AS action_p50,
        quantileExactInclusive(0.95)(action_latency_s) AS action_p95,
        quantileExactInclusive(0.99)(action_latency_s) AS action_p99,
        quantileExactInclusive(0.5)(recovery_s) AS recovery_p50,
        quantileExactInclusive(0.95)(recovery_s) AS recovery_p95,
        quantileExactInclusive(0.99)(recovery_s) AS recovery_p99
    FROM {db}.incident_summary
    UNION ALL
    SELECT
        toString(category),
        1,
        count(),
        quantileExactInclusive(0.5)(detection_latency_s),
        quantileExactInclusive(0.95)(detection_latency_s),
        quantileExactInclusive(0.99)(detection_latency_s),
        count(action_latency_s),
        quantileExactInclusive(0.5)(action_latency_s),
        quantileExactInclusive(0.95)(action_latency_s),
        quantileExactInclusive(0.99)(action_latency_s),
        quantileExactInclusive(0.5)(recovery_s),
        quantileExactInclusive(0.95)(recovery_s),
        quantileExactInclusive(0.99)(recovery_s)
    FROM {db}.incident_summary
    GROUP BY category
)
ORDER BY is_category, category;

-- Repeat offenders: incidents per culprit node, most first, with when it was last blamed.
CREATE OR REPLACE VIEW {db}.repeat_offenders AS
SELECT
    assumeNotNull(culprit_node) AS node,
    count() AS incidents,
    min(detected_at) AS first_seen,
    max(detected_at) AS last_seen,
    arraySort(groupUniqArray(toString(category))) AS categories,
    uniqExact(job_id) AS jobs_hit,
    countIf(decision_action = 'drain_and_requeue' AND actions_done > 0) AS drains
FROM {db}.incident_summary
WHERE culprit_node IS NOT NULL
GROUP BY node
ORDER BY incidents DESC, last_seen DESC;

-- Restarts per job: requeues the executor carried out and verified.
CREATE OR REPLACE VIEW {db}.job_restarts AS
SELECT
    job_id,
    countIf(status = 'done' AND action IN ('requeue', 'drain_and_requeue')) AS restarts,
    countIf(status = 'done' AND action = 'stop') AS stops,
    countIf(status = 'failed') AS failed_actions,
    uniqExact(incident_id) AS incidents,
    maxIf(verified_at, status = 'done' AND action IN ('requeue', 'drain_and_requeue')) AS last_restart_at
FROM {db}.action_results FINAL
WHERE job_id IS NOT NULL
GROUP BY job_id;

-- GPU-hours saved, an estimate per incident whose action was verified:
--
--   gpus             = job_node_count * 8
--                      (assumption: 8 GPUs per node, as on HGX/DGX nodes, since the
--                      audit records nodes, not GPUs)
--   baseline_s       = 600 + 1800
--                      600 s: the NCCL watchdog's default timeout, which is how long
--                      the surviving ranks hang before the job dies without us.
--                      1800 s: an assumed manual response, an operator noticing the
--                      dead job, draining the node and resubmitting.
--   ours_s           = recovery_s = action verified - first fault signal
--   gpu_hours_saved  = gpus * (baseline_s - ours_s) / 3600
--
-- Not clamped at zero: a response slower than the baseline (a recommendation
-- that waited hours for an operator) shows as a loss. The same baseline is used
-- for every category, although a user_code crash ends the job sooner than a
-- hang would. docs/audit.md repeats this.
CREATE OR REPLACE VIEW {db}.gpu_hours_saved AS
SELECT
    incident_id,
    detected_at,
    job_id,
    partition,
    category,
    culprit_node,
    job_node_count,
    job_node_count * 8 AS gpus,
    600 AS watchdog_s,
    1800 AS manual_response_s,
    watchdog_s + manual_response_s AS baseline_s,
    assumeNotNull(recovery_s) AS ours_s,
    gpus * (baseline_s - ours_s) / 3600.0 AS gpu_hours_saved
FROM {db}.incident_summary
WHERE recovery_s IS NOT NULL;

-- Everything that happened to a job, one row per event, in pipeline order
-- (stage) where times tie. Kernel anomalies carry no job id: they get the job
-- of the incident that lists them in anomaly_ids.
CREATE OR REPLACE VIEW {db}.timeline AS
SELECT
    a.event_time AS time,
    'anomaly' AS kind,
    toUInt8(1) AS stage,
    a.event_id AS id,
    m.incident_id AS incident_id,
    if(a.job_id IS NULL, m.job_id, a.job_id) AS job_id,
    a.node AS node,
    a.partition AS partition,
    toString(a.category) AS category,
    concat(
        a.signature, ' (', a.role, ', ', a.severity, ')',
        if(a.node IS NULL, '', concat(' on ', assumeNotNull(a.node))),
        if(a.rank IS NULL, '', concat(' rank ', toString(assumeNotNull(a.rank))))
    ) AS summary,
    a.line AS detail
FROM {db}.anomalies AS a FINAL
LEFT JOIN (
    SELECT anomaly_id, any(incident_id) AS incident_id, any(job_id) AS job_id
    FROM {db}.incidents FINAL
    ARRAY JOIN anomaly_ids AS anomaly_id
    GROUP BY anomaly_id
) AS m ON m.anomaly_id = a.event_id
UNION ALL
SELECT
    event_time, 'incident', toUInt8(2), incident_id, incident_id, job_id, culprit_node, partition, toString(category),
    concat(
        category, ' ', severity, ', culprit ', ifNull(culprit_node, '?'),
        ', confidence ', toString(round(confidence, 2)), ', recommends ', recommended_action,
        ', detection ', toString(detection_latency_s), ' s'
    ),
    explanation
FROM {db}.incidents FINAL
UNION ALL
SELECT
    event_time, 'decision', toUInt8(3), decision_id, incident_id, job_id, culprit_node, partition, toString(category),
    concat(kind, ': ', action, ' (mode ', mode, ', rule ', rule, ')'),
    reason
FROM {db}.decisions FINAL
UNION ALL
SELECT
    ap.event_time, 'approval', toUInt8(4), ap.approval_id, ap.incident_id, ap.job_id, dn.culprit_node, ap.partition,
    toString(ap.category),
    concat(ap.verdict, ' ', ap.action, ' by ', ap.operator, if(ap.reason IS NULL, '', concat(' (', assumeNotNull(ap.reason), ')'))),
    ap.comment
FROM {db}.approvals AS ap FINAL
LEFT JOIN (
    SELECT decision_id, any(culprit_node) AS culprit_node FROM {db}.decisions FINAL GROUP BY decision_id
) AS dn ON dn.decision_id = ap.decision_id
UNION ALL
SELECT
    event_time, 'guardrail_trip', toUInt8(5), event_id, incident_id, job_id, node, partition, '',
    concat('guardrail ', guardrail, ' stopped ', action, if(node IS NULL, '', concat(' ', assumeNotNull(node)))),
    detail
FROM {db}.guardrail_trips FINAL
UNION ALL
SELECT
    event_time, 'action', toUInt8(6), action_id, incident_id, job_id, node, partition, '',
    concat(action, if(node IS NULL, '', concat(' ', assumeNotNull(node))), ' requested by ', requested_by),
    reason
FROM {db}.actions FINAL
UNION ALL
SELECT
    event_time, 'action_result', toUInt8(7), action_id, incident_id, job_id, node, NULL, '',
    concat(
        status, ': ', action,
        if(action_latency_s IS NULL, '', concat(', action latency ', toString(assumeNotNull(action_latency_s)), ' s'))
    ),
    concat(arrayStringConcat(steps, '; '), if(error IS NULL, '', concat(' error: ', assumeNotNull(error))))
FROM {db}.action_results FINAL;
