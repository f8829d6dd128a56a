-- trainmedic audit trail, version 11: incidents no longer carry an action (schema
-- version 2: policy alone chooses it; new rows hold '' in incidents.recommended_action).
-- incident_summary.recommended_action comes from policy's decision for those rows, and
-- the timeline's incident line no longer says "recommends" (the decision line does).
-- The other views are unchanged from 007.

CREATE OR REPLACE VIEW {db}.incident_summary AS
SELECT
    i.incident_id AS incident_id,
    i.event_time AS detected_at,
    i.first_signal_time AS first_signal_time,
    nullIf(i.job_id, '') AS job_id,
    nullIf(i.partition, '') AS partition,
    i.job_nodes AS job_nodes,
    toUInt32(length(i.job_nodes)) AS job_node_count,
    i.category AS category,
    i.severity AS severity,
    nullIf(i.culprit_node, '') AS culprit_node,
    i.confidence AS confidence,
    -- What the incident calls for: the recorded one of rows from before policy alone chose it,
    -- else policy's latest decision.
    if(i.recommended_action = '', d.decision_action, i.recommended_action) AS recommended_action,
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

CREATE OR REPLACE VIEW {db}.timeline AS
SELECT
    a.event_time AS time,
    'anomaly' AS kind,
    toUInt8(1) AS stage,
    a.event_id AS id,
    m.incident_id AS incident_id,
    nullIf(if(a.job_id = '', m.job_id, a.job_id), '') AS job_id,
    nullIf(a.node, '') AS node,
    nullIf(a.partition, '') AS partition,
    toString(a.category) AS category,
    concat(
        a.signature, ' (', a.role, ', ', a.severity, ')',
        if(a.node = '', '', concat(' on ', a.node)),
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
    event_time, 'incident', toUInt8(2), incident_id, incident_id, nullIf(job_id, ''), nullIf(culprit_node, ''),
    nullIf(partition, ''), toString(category),
    concat(
        category, ' ', severity, ', culprit ', if(culprit_node = '', '?', culprit_node),
        ', confidence ', toString(round(confidence, 2)),
        ', detection ', toString(detection_latency_s), ' s'
    ),
    explanation
FROM {db}.incidents FINAL
UNION ALL
SELECT
    event_time, 'decision', toUInt8(3), decision_id, incident_id, nullIf(job_id, ''), nullIf(culprit_node, ''),
    nullIf(partition, ''), toString(category),
    concat(kind, ': ', action, ' (mode ', mode, ', rule ', rule, ')'),
    reason
FROM {db}.decisions FINAL
UNION ALL
SELECT
    ap.event_time, 'approval', toUInt8(4), ap.approval_id, ap.incident_id, nullIf(ap.job_id, ''),
    nullIf(dn.culprit_node, ''), nullIf(ap.partition, ''),
    toString(ap.category),
    concat(ap.verdict, ' ', ap.action, ' by ', ap.operator, if(ap.reason IS NULL, '', concat(' (', assumeNotNull(ap.reason), ')'))),
    ap.comment
FROM {db}.approvals AS ap FINAL
LEFT JOIN (
    SELECT decision_id, any(culprit_node) AS culprit_node FROM {db}.decisions FINAL GROUP BY decision_id
) AS dn ON dn.decision_id = ap.decision_id
UNION ALL
SELECT
    event_time, 'guardrail_trip', toUInt8(5), event_id, incident_id, nullIf(job_id, ''), nullIf(node, ''),
    nullIf(partition, ''), '',
    concat('guardrail ', guardrail, ' stopped ', action, if(node = '', '', concat(' ', node))),
    detail
FROM {db}.guardrail_trips FINAL
UNION ALL
SELECT
    event_time, 'action', toUInt8(6), action_id, incident_id, nullIf(job_id, ''), nullIf(node, ''),
    nullIf(partition, ''), '',
    concat(action, if(node = '', '', concat(' ', node)), ' requested by ', requested_by),
    reason
FROM {db}.actions FINAL
UNION ALL
SELECT
    event_time, 'action_result', toUInt8(7), action_id, incident_id, nullIf(job_id, ''), nullIf(node, ''), NULL, '',
    concat(
        status, ': ', action,
        if(action_latency_s IS NULL, '', concat(', action latency ', toString(assumeNotNull(action_latency_s)), ' s'))
    ),
    concat(arrayStringConcat(steps, '; '), if(error IS NULL, '', concat(' error: ', assumeNotNull(error))))
FROM {db}.action_results FINAL;
