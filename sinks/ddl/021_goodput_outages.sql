-- trainmedic audit trail, version 21: goodput without the two over-counts of 016 (docs/audit.md,
-- "Goodput"): one outage is charged once, and only an incident that stopped its job is charged.
-- Replaces the views of 016_goodput.sql; every column of 016 is kept, with the same meaning except:
--
-- incident_goodput, one row per incident:
--   lost_basis          'outage': the job stopped and ran again; 'still down': it stopped and is not
--                       (yet) running again; 'job kept running': nothing stopped it; 'within outage': it
--                       did not stop the job, but its fault fell inside an outage of the job that another
--                       incident (charged_to) stopped; 'no job'
--   stop_evidence       why the job counts as stopped, NULL if it kept running:
--                       'stopping action done'       a requeue / stop / drain_and_requeue / drain_and_stop
--                                                    of the incident verified done (action_results)
--                       'job stopped before the incident'  between the fault and the incident an attempt
--                                                    of the job ended, or the scheduler reported it in a
--                                                    state other than RUNNING (it died of the fault)
--                       'stopping action without a result, ran again'  one was asked (actions), no result
--                                                    is recorded, and the job ran again after the fault
--   running_again_at    as 016 for 'outage' rows; NULL otherwise (a job that kept running never stopped,
--                       and an incident 'within outage' did not stop it: the outage recovers through the
--                       incidents that stopped the job)
--   time_to_recover_s   fault -> running again, per incident ('outage' rows only: the incidents that
--                       stopped the job)
--   gpu_hours_lost      per job, the fault -> running again intervals of the incidents that stopped it are
--                       merged where they overlap (gaps and islands over window functions: ClickHouse has
--                       no recursive CTE). One merged outage is charged once, to the incident whose fault
--                       came first: its GPUs (the largest len(job_nodes) * 8 among the outage's incidents)
--                       * (the outage's last running again - its first fault) / 3600; the outage's other
--                       incidents 0. 'within outage', 'job kept running' and 'no job': 0. 'still down':
--                       NULL, as in 016 (its 'within outage' incidents 0).
--   charged_to          the incident the outage was charged to (itself for the first; also on the outage's
--                       'within outage' incidents); NULL when the job kept running or there is no job
--
-- job_goodput: incidents_not_running_again counts 'still down' incidents (that stopped the job); new
-- incidents_kept_running and outages (the merged outages charged); gpu_hours_lost sums incident_goodput's,
-- so each outage once. An incident 'within outage' is in `incidents` only.
--
-- sinks/audit_queries.py renders the same SQL for bounded reads (goodput()); a test checks that the
-- statements below are its text with every filter "1".


CREATE OR REPLACE VIEW {db}.incident_goodput AS
WITH
    faults AS (
        SELECT incident_id, job_id, first_signal_time, event_time FROM {db}.incidents FINAL WHERE job_id != '' AND (1)
    ),
    attempts AS (
    SELECT job_id, lineage_id, attempt, started_at,
        tupleElement(last, 1) AS ended_at, tupleElement(last, 2) AS progressed
    FROM (
        SELECT job_id, lineage_id, attempt, min(started_at) AS started_at,
            argMax(tuple(ended_at, progressed), (event_time, ended_at IS NOT NULL, cause_incident_id IS NOT NULL)) AS last
        FROM {db}.job_attempts FINAL
        WHERE job_id != '' AND (1)
        GROUP BY job_id, lineage_id, attempt
    )
    ),
    next_attempt AS (
        SELECT f.incident_id AS incident_id, toNullable(min(a.started_at)) AS started_at,
            tupleElement(argMin(tuple(a.ended_at), a.started_at), 1) AS ended_at
        FROM faults AS f
        INNER JOIN attempts AS a ON a.job_id = f.job_id
        WHERE a.started_at > f.first_signal_time
        GROUP BY f.incident_id
    ),
    ended AS (
        SELECT f.incident_id AS incident_id, count() AS attempts_ended
        FROM faults AS f
        INNER JOIN attempts AS a ON a.job_id = f.job_id
        WHERE a.ended_at >= f.first_signal_time AND a.ended_at <= f.event_time
        GROUP BY f.incident_id
    ),
    running AS (
        SELECT f.incident_id AS incident_id,
            minIfOrNull(s.event_time, s.running AND s.event_time > f.first_signal_time) AS after_fault,
            minIfOrNull(
                s.event_time,
                s.running AND n.started_at IS NOT NULL AND s.event_time >= n.started_at AND (n.ended_at IS NULL OR s.event_time <= n.ended_at)
            ) AS in_next_attempt,
            countIf(NOT s.running AND s.event_time >= f.first_signal_time AND s.event_time <= f.event_time) AS left_running
        FROM faults AS f
        INNER JOIN (
            SELECT job_id, event_time, state = 'RUNNING' AS running FROM {db}.sched_events FINAL
            WHERE kind = 'job' AND state != 'SNAPSHOT' AND job_id != '' AND (1)
        ) AS s ON s.job_id = f.job_id
        LEFT JOIN next_attempt AS n ON n.incident_id = f.incident_id
        GROUP BY f.incident_id
    ),
    results AS (
        SELECT incident_id, minIf(verified_at, status = 'done') AS acted_at,
            countIf(status = 'done' AND action IN ('requeue', 'stop', 'drain_and_requeue', 'drain_and_stop')) AS stops_done,
            countIf(action IN ('requeue', 'stop', 'drain_and_requeue', 'drain_and_stop')) AS stop_results
        FROM {db}.action_results FINAL WHERE 1 GROUP BY incident_id
    ),
    asked AS (
        SELECT incident_id, countIf(action IN ('requeue', 'stop', 'drain_and_requeue', 'drain_and_stop')) AS stops_asked
        FROM {db}.actions FINAL WHERE 1 GROUP BY incident_id
    ),
    judged AS (
        SELECT
            i.incident_id AS incident_id,
            nullIf(i.job_id, '') AS job_id,
            i.category AS category,
            nullIf(i.culprit_node, '') AS culprit_node,
            toUInt32(length(i.job_nodes)) * 8 AS gpus,
            i.first_signal_time AS fault_at,
            i.event_time AS detected_at,
            r.acted_at AS acted_at,
            coalesce(g.in_next_attempt, n.started_at, g.after_fault) AS ran_again_at,
            multiIf(
                g.in_next_attempt IS NOT NULL, 'next attempt RUNNING',
                n.started_at IS NOT NULL, 'next attempt start',
                g.after_fault IS NOT NULL, 'RUNNING after the fault',
                NULL
            ) AS ran_again_from,
            multiIf(
                ifNull(r.stops_done, 0) > 0, 'stopping action done',
                ifNull(e.attempts_ended, 0) + ifNull(g.left_running, 0) > 0, 'job stopped before the incident',
                ifNull(a.stops_asked, 0) > 0 AND ifNull(r.stop_results, 0) = 0 AND ran_again_at IS NOT NULL,
                'stopping action without a result, ran again',
                NULL
            ) AS stop_evidence,
            toUInt8(stop_evidence IS NULL) AS kept,
            toUnixTimestamp64Milli(i.first_signal_time) AS start_ms,
            multiIf(kept = 1, start_ms, ran_again_at IS NULL, toInt64(253402300799999), toUnixTimestamp64Milli(assumeNotNull(ran_again_at))) AS end_ms
        FROM (SELECT * FROM {db}.incidents FINAL WHERE 1) AS i
        LEFT JOIN results AS r ON r.incident_id = i.incident_id
        LEFT JOIN asked AS a ON a.incident_id = i.incident_id
        LEFT JOIN next_attempt AS n ON n.incident_id = i.incident_id
        LEFT JOIN running AS g ON g.incident_id = i.incident_id
        LEFT JOIN ended AS e ON e.incident_id = i.incident_id
    ),
    chained AS (
        SELECT *,
            max(end_ms) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, '') ORDER BY start_ms, kept, incident_id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach_ms,
            row_number() OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, '') ORDER BY start_ms, kept, incident_id) AS n
        FROM judged
    ),
    outages AS (
        SELECT *, sum(toUInt64(n = 1 OR start_ms >= reach_ms)) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, '') ORDER BY start_ms, kept, incident_id ROWS UNBOUNDED PRECEDING) AS outage
        FROM chained
    ),
    charged AS (
        SELECT *,
            argMin(incident_id, (start_ms, kept, incident_id)) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, ''), outage) AS first_incident,
            countIf(kept = 0) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, ''), outage) AS stopping,
            max(gpus) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, ''), outage) AS outage_gpus,
            min(start_ms) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, ''), outage) AS from_ms,
            max(end_ms) OVER (PARTITION BY job_id, if(job_id IS NULL, incident_id, ''), outage) AS until_ms
        FROM outages
    )
SELECT
    incident_id,
    job_id,
    category,
    culprit_node,
    gpus,
    fault_at,
    detected_at,
    acted_at,
    multiIf(
        job_id IS NULL, 'no job',
        stopping = 0, 'job kept running',
        kept = 1, 'within outage',
        until_ms = toInt64(253402300799999), 'still down',
        'outage'
    ) AS lost_basis,
    if(lost_basis = 'outage', ran_again_at, NULL) AS running_again_at,
    if(lost_basis = 'outage', ran_again_from, NULL) AS running_again_from,
    (toUnixTimestamp64Milli(detected_at) - toUnixTimestamp64Milli(fault_at)) / 1000.0 AS time_to_detect_s,
    if(acted_at IS NULL, NULL, (toUnixTimestamp64Milli(assumeNotNull(acted_at)) - toUnixTimestamp64Milli(detected_at)) / 1000.0) AS time_to_act_s,
    if(running_again_at IS NULL, NULL, (toUnixTimestamp64Milli(assumeNotNull(running_again_at)) - toUnixTimestamp64Milli(fault_at)) / 1000.0) AS time_to_recover_s,
    multiIf(
        lost_basis = 'outage', if(first_incident = incident_id, outage_gpus * ((until_ms - from_ms) / 1000.0) / 3600.0, 0.0),
        lost_basis = 'still down', NULL,
        0.0
    ) AS gpu_hours_lost,
    if(lost_basis IN ('outage', 'still down', 'within outage'), first_incident, NULL) AS charged_to,
    stop_evidence
FROM charged;

CREATE OR REPLACE VIEW {db}.job_goodput AS
WITH
    attempts AS (
    SELECT job_id, lineage_id, attempt, started_at,
        tupleElement(last, 1) AS ended_at, tupleElement(last, 2) AS progressed
    FROM (
        SELECT job_id, lineage_id, attempt, min(started_at) AS started_at,
            argMax(tuple(ended_at, progressed), (event_time, ended_at IS NOT NULL, cause_incident_id IS NOT NULL)) AS last
        FROM {db}.job_attempts FINAL
        WHERE job_id != '' AND (1)
        GROUP BY job_id, lineage_id, attempt
    )
    ),
    lineages AS (
        SELECT job_id, lineage_id,
            count() AS attempts,
            countIf(ifNull(progressed, false)) AS attempts_progressed,
            countIf(NOT ifNull(progressed, true)) AS attempts_no_progress,
            countIf(progressed IS NULL) AS attempts_unknown,
            countIf(ended_at IS NULL) AS attempts_running,
            min(started_at) AS first_started_at,
            max(ifNull(ended_at, now64(3, 'UTC'))) AS until,
            sumIf(duration_s, ifNull(progressed, false)) AS productive_s,
            sumIf(duration_s, NOT ifNull(progressed, true)) AS unproductive_s,
            sumIf(duration_s, progressed IS NULL) AS unknown_s
        FROM (SELECT *, (toUnixTimestamp64Milli(ifNull(ended_at, now64(3, 'UTC'))) - toUnixTimestamp64Milli(started_at)) / 1000.0 AS duration_s FROM attempts)
        GROUP BY job_id, lineage_id
    ),
    jobs AS (
        SELECT l.job_id AS job_id,
            count() AS lineages,
            sum(l.attempts) AS attempts,
            sum(l.attempts) - count() AS restarts,
            sum(l.attempts_running) AS attempts_running,
            sum(l.attempts_progressed) AS attempts_progressed,
            sum(l.attempts_no_progress) AS attempts_no_progress,
            sum(l.attempts_unknown) AS attempts_unknown,
            toNullable(min(l.first_started_at)) AS first_started_at,
            if(sum(l.attempts_running) > 0, NULL, max(l.until)) AS last_ended_at,
            toNullable(sum((toUnixTimestamp64Milli(l.until) - toUnixTimestamp64Milli(l.first_started_at)) / 1000.0)) AS wall_s,
            toNullable(sum(l.productive_s)) AS productive_s,
            toNullable(sum(l.unproductive_s)) AS unproductive_s,
            toNullable(sum(l.unknown_s)) AS unknown_s
        FROM lineages AS l
        GROUP BY l.job_id
    ),
    lost AS (
        SELECT assumeNotNull(job_id) AS job_id, count() AS incidents,
            countIf(lost_basis = 'still down') AS incidents_not_running_again,
            countIf(lost_basis = 'job kept running') AS incidents_kept_running,
            countIf(lost_basis = 'outage' AND charged_to = incident_id) AS outages,
            sum(gpu_hours_lost) AS gpu_hours_lost
        FROM {db}.incident_goodput
        WHERE job_id IS NOT NULL
        GROUP BY job_id
    )
SELECT
    k.job_id AS job_id,
    j.lineages AS lineages,
    j.attempts AS attempts,
    j.restarts AS restarts,
    j.attempts_running AS attempts_running,
    j.attempts_progressed AS attempts_progressed,
    j.attempts_no_progress AS attempts_no_progress,
    j.attempts_unknown AS attempts_unknown,
    j.first_started_at AS first_started_at,
    j.last_ended_at AS last_ended_at,
    j.wall_s AS wall_s,
    j.productive_s AS productive_s,
    j.unproductive_s AS unproductive_s,
    j.unknown_s AS unknown_s,
    if(j.attempts_progressed + j.attempts_no_progress = 0 OR j.wall_s - j.unknown_s <= 0, NULL, j.productive_s / (j.wall_s - j.unknown_s)) AS effective_ratio,
    l.incidents AS incidents,
    l.incidents_not_running_again AS incidents_not_running_again,
    ifNull(l.gpu_hours_lost, 0) AS gpu_hours_lost,
    l.incidents_kept_running AS incidents_kept_running,
    l.outages AS outages
FROM (SELECT job_id FROM jobs UNION DISTINCT SELECT job_id FROM lost) AS k
LEFT JOIN jobs AS j ON j.job_id = k.job_id
LEFT JOIN lost AS l ON l.job_id = k.job_id;
