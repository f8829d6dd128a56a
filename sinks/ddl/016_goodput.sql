-- trainmedic audit trail, version 16: goodput (docs/audit.md, "Goodput"): what each incident cost
-- in GPU-hours from the fault until the job ran again, and how much of each job's wall time across its
-- restarts was productive training (job_attempts, 015). Plain views over FINAL, as 003.
--
-- incident_goodput, one row per incident:
--   fault_at            the incident's first_signal_time (the earliest evidence of the fault)
--   detected_at         the incident published (event_time)
--   acted_at            the first action result verified (status done), NULL if none
--   running_again_at    the job RUNNING again after the fault: the job's next attempt (the first one
--                       started after fault_at) at its first scheduler RUNNING report while it lasted;
--                       else that attempt's start (its scheduler events not in the audit: raw retention);
--                       else, with no attempt recorded, the job's first RUNNING report after the fault;
--                       else NULL: not (yet) running again. running_again_from says which.
--   gpus                len(job_nodes) * 8 (8 GPUs per node, as gpu_hours_saved: the audit records nodes)
--   time_to_detect_s    fault -> detected      (= detection_latency_s)
--   time_to_act_s       detected -> acted      (= action_latency_s of the first verified result)
--   time_to_recover_s   fault -> running again (not incident_summary.recovery_s: fault -> action verified)
--   gpu_hours_lost      gpus * time_to_recover_s / 3600; NULL while the job is not running again (never
--                       counted as 0 or as "until now": job_goodput counts those incidents apart)
--
-- job_goodput, one row per job id (with attempts or incidents), its lineages summed (an id reused by
-- another job is another lineage, 015):
--   attempts, restarts (attempts - lineages), incidents, incidents_not_running_again, gpu_hours_lost (sum)
--   wall_s              per lineage, first attempt start -> last attempt end (now while one runs), summed
--   productive_s        the durations of attempts that progressed (a higher step or a new checkpoint)
--   unproductive_s      ... of attempts that made no progress; unknown_s: of attempts whose progress is
--                       unknown (the job never reported any, or the attempt still runs: judged at its end)
--   effective_ratio     productive_s / (wall_s - unknown_s): the share of the wall time whose outcome is
--                       known that trained; the gaps between attempts (queued after a requeue) count as
--                       not productive. NULL when no attempt has a progress verdict.
--
-- sinks/audit_queries.py renders the same SQL for bounded reads (goodput()); a test checks that the
-- statements below are its text with every filter "1".


CREATE OR REPLACE VIEW {db}.incident_goodput AS
WITH
    faults AS (
        SELECT incident_id, job_id, first_signal_time FROM {db}.incidents FINAL WHERE job_id != '' AND (1)
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
    running AS (
        SELECT f.incident_id AS incident_id,
            minIfOrNull(s.event_time, s.event_time > f.first_signal_time) AS after_fault,
            minIfOrNull(
                s.event_time,
                n.started_at IS NOT NULL AND s.event_time >= n.started_at AND (n.ended_at IS NULL OR s.event_time <= n.ended_at)
            ) AS in_next_attempt
        FROM faults AS f
        INNER JOIN (
            SELECT job_id, event_time FROM {db}.sched_events FINAL
            WHERE kind = 'job' AND state = 'RUNNING' AND job_id != '' AND (1)
        ) AS s ON s.job_id = f.job_id
        LEFT JOIN next_attempt AS n ON n.incident_id = f.incident_id
        GROUP BY f.incident_id
    )
SELECT
    i.incident_id AS incident_id,
    nullIf(i.job_id, '') AS job_id,
    i.category AS category,
    nullIf(i.culprit_node, '') AS culprit_node,
    toUInt32(length(i.job_nodes)) * 8 AS gpus,
    i.first_signal_time AS fault_at,
    i.event_time AS detected_at,
    r.acted_at AS acted_at,
    coalesce(g.in_next_attempt, n.started_at, g.after_fault) AS running_again_at,
    multiIf(
        g.in_next_attempt IS NOT NULL, 'next attempt RUNNING',
        n.started_at IS NOT NULL, 'next attempt start',
        g.after_fault IS NOT NULL, 'RUNNING after the fault',
        NULL
    ) AS running_again_from,
    (toUnixTimestamp64Milli(i.event_time) - toUnixTimestamp64Milli(i.first_signal_time)) / 1000.0 AS time_to_detect_s,
    if(acted_at IS NULL, NULL, (toUnixTimestamp64Milli(assumeNotNull(acted_at)) - toUnixTimestamp64Milli(i.event_time)) / 1000.0) AS time_to_act_s,
    if(running_again_at IS NULL, NULL, (toUnixTimestamp64Milli(assumeNotNull(running_again_at)) - toUnixTimestamp64Milli(i.first_signal_time)) / 1000.0) AS time_to_recover_s,
    gpus * time_to_recover_s / 3600.0 AS gpu_hours_lost
FROM (SELECT * FROM {db}.incidents FINAL WHERE 1) AS i
LEFT JOIN (
    SELECT incident_id, minIf(verified_at, status = 'done') AS acted_at
    FROM {db}.action_results FINAL WHERE 1 GROUP BY incident_id
) AS r ON r.incident_id = i.incident_id
LEFT JOIN next_attempt AS n ON n.incident_id = i.incident_id
LEFT JOIN running AS g ON g.incident_id = i.incident_id;

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
            countIf(running_again_at IS NULL) AS incidents_not_running_again,
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
    ifNull(l.gpu_hours_lost, 0) AS gpu_hours_lost
FROM (SELECT job_id FROM jobs UNION DISTINCT SELECT job_id FROM lost) AS k
LEFT JOIN jobs AS j ON j.job_id = k.job_id
LEFT JOIN lost AS l ON l.job_id = k.job_id;
