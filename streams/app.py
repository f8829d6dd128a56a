"""The Faust app: detection, attribution and policy agents.

Records travel as raw bytes and are decoded with schemas.codec, so schemas/
stays the one source of truth for event types; they are published through
bus.publish.prepare. Settings come from the one settings model
(trainmedic.settings: TRAINMEDIC_* environment, then the config file), which
`trainmedic config show` prints.
Run: python -m trainmedic.stack.streams_worker worker --without-web -l info
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, TypeVar

import faust
import orjson
from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]
from confluent_kafka import KafkaException

from bus import health
from bus.config import heartbeat_interval_ms, security, session_timeout_ms
from bus.deadletter import make_dead_letter
from bus.fit import fits
from bus.identity import (
    NODE_SIGNATURE_HEADER,
    NODE_SIGNED_TOPICS,
    SIGNATURE_INVALID,
    check_node_signature,
    check_site_secret,
)
from bus.publish import CLIENT_DEFAULT_MAX_BYTES, prepare
from schemas.codec import DecodeError, decode, decode_as_read, encode
from schemas.events import (
    Anomaly,
    Event,
    GpuSample,
    GpuSampleBatch,
    HealthEvent,
    Incident,
    JobAttempt,
    KernelEvent,
    LogBatch,
    Migration,
    NetPortSample,
    ProgressBatch,
    SchedEvent,
)
from schemas.ids import cluster_scoped, current_cluster
from schemas.topics import (
    ACTIONS,
    ANOMALIES,
    ANOMALIES_BY_JOB,
    DEADLETTER,
    DECISIONS,
    GPU_SAMPLES,
    GPU_SAMPLES_BY_JOB,
    HEALTH_EXTERNAL,
    INCIDENTS,
    INCIDENTS_BY_DOMAIN,
    JOB_ATTEMPTS,
    JOB_LOGS,
    JOB_PROGRESS,
    MIGRATIONS,
    MODE_CHANGES,
    NET_PORTS,
    NODE_KERNEL,
    SCHED_EVENTS,
    Topic,
)
from schemas.vocab import STOPS
from streams import metrics
from streams.attribution import ALLOCATION_TTL_S, Attributor
from streams.changelog_ends import fix_highwaters
from streams.credentials import faust_credentials
from streams.detectors.divergence import DivergenceDetector
from streams.detectors.external import ExternalHealthDetector
from streams.detectors.gpu_health import GpuHealthDetector
from streams.detectors.hang import HangDetector, job_state_kind
from streams.detectors.kernel_text import KernelTextDetector
from streams.detectors.net_ports import NetPortDetector
from streams.detectors.prefailure import PreFailureDetector
from streams.detectors.signatures import SignatureDetector
from streams.detectors.straggler import GPU_SAMPLE_EVERY_S, StragglerDetector
from streams.detectors.throughput import ThroughputDetector
from streams.detectors.xid import XidDetector
from streams.fetching import cap_fetch_wait, pace_fetches
from streams.fleet import DomainCorrelator, TopologyCache, watched
from streams.gpu_batches import BATCH_EVERY_S, GpuBatches
from streams.lineage import Lineages
from streams.migration import MigrationBook, absorbed_decision, answered_by, predicted_incident, requeue_action
from streams.modes import ModeState
from streams.placement import PlacementIndex, placement_change
from streams.policy import RESTARTS
from streams.policy_store import PolicyStore
from streams.recovery import read_actions, read_history, read_migrations
from streams.seeking import rewind_uncommitted
from streams.watermark import PartitionClocks, Watermark
from trainmedic.settings import Settings
from trainmedic.settings import apply as apply_settings

log = logging.getLogger("trainmedic.streams")
E = TypeVar("E", bound=Event)

# The one settings model (trainmedic.settings): environment, then the config file. The worker
# runs as `python -m trainmedic.stack.streams_worker worker`, which has no flags of ours.
SETTINGS = Settings.load()
apply_settings(SETTINGS)
BOOTSTRAP = SETTINGS.bootstrap or "127.0.0.1:9092"


def _node_secret(secret: str | None) -> tuple[bytes | None, str | None]:
    """The site secret the node records' signatures are checked with, or why it cannot be used."""
    if not secret:
        return None, None
    try:
        return check_site_secret(secret), None
    except ValueError as exc:
        log.error("setting site_secret: %s: every signed GPU, kernel and port record is refused", exc)
        return None, str(exc)


# With site_secret, node records (NODE_SIGNED_TOPICS) are checked against their node's key
# (bus.identity.check_node_signature); without it, they are taken as they come.
NODE_SECRET, NODE_SECRET_ERROR = _node_secret(SETTINGS.secret("site_secret"))
NODE_SIGNING_REQUIRED = SETTINGS.node_signing_required
# The topics' partition count (the setting topic_partitions, fixed at install): tables are made
# with it and job ownership is computed with it.
PARTITIONS = SETTINGS.topic_partitions
FETCH_MAX_WAIT_MS = SETTINGS.fetch_max_wait_ms
PRODUCER_LINGER_S = 0.005


cap_fetch_wait(FETCH_MAX_WAIT_MS)
pace_fetches(SETTINGS.fetch_pace_ms / 1000.0)
rewind_uncommitted()
# Table recovery reads each changelog to the end a fetch reports, not the embedded broker's ListOffsets.
fix_highwaters(BOOTSTRAP)

app = faust.App(
    cluster_scoped(SETTINGS.streams_id),
    broker=",".join(f"kafka://{h}" for h in BOOTSTRAP.split(",")),
    broker_credentials=faust_credentials(security()),
    store="memory://",
    topic_partitions=PARTITIONS,
    consumer_auto_offset_reset="earliest",
    # Without these, a worker start takes ~32 s on the embedded broker (the settings' session timeout).
    broker_session_timeout=session_timeout_ms() / 1000,
    broker_heartbeat_interval=heartbeat_interval_ms() / 1000,
    broker_rebalance_timeout=20,
    # Faust's default (0) sends each forward and anomaly as soon as it is made: at fleet scale that
    # is a produce request per record, paid in the worker's socket writes and the broker's request
    # handling. A few milliseconds per hop batch them; a fault crosses three hops.
    producer_linger=PRODUCER_LINGER_S,
    # Faust stops a worker whose table read further into a changelog than the broker's end offset
    # (meant for a RocksDB file left over a deleted topic; our store is memory, rebuilt from the
    # changelog at each start). The embedded broker answers that end offset as the base offset of
    # the partition's last batch + 1 (tansu-io/tansu v0.6.0, tansu-storage/src/dynostore.rs,
    # `list_offsets`), below what a batch of several records already delivered: every rebalance of
    # several workers stopped every worker that had read the placements changelog, one after the
    # other (docs/environment.md).
    recovery_consistency_check=False,
    web_enabled=False,
    datadir=str(SETTINGS.streams_data_dir),
)


def _topic(*names: str) -> Any:
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


# The topology. Input topics are keyed by job (logs, progress, job events) or by node (GPU
# samples, kernel lines, external health). What judges a job - attribution, hang, straggler -
# reads job-keyed topics only, so N workers split the jobs between them: node-keyed evidence is
# re-keyed to each job running on its node (the placement table) through a repartition topic.
logs_topic = _topic(JOB_LOGS.name)
gpu_topic = _topic(GPU_SAMPLES.name)
signals_topic = _topic(JOB_PROGRESS.name, GPU_SAMPLES_BY_JOB.name, SCHED_EVENTS.name)
_SIGNAL_TYPES: dict[str, type[Event]] = {
    JOB_PROGRESS.name: ProgressBatch,
    GPU_SAMPLES_BY_JOB.name: GpuSampleBatch,
    SCHED_EVENTS.name: SchedEvent,
}
kernel_topic = _topic(NODE_KERNEL.name)
net_topic = _topic(NET_PORTS.name)
external_topic = _topic(HEALTH_EXTERNAL.name)
sched_topic = _topic(SCHED_EVENTS.name)
anomalies_topic = _topic(ANOMALIES.name)
attribution_topic = _topic(ANOMALIES.name, ANOMALIES_BY_JOB.name, SCHED_EVENTS.name)
incidents_topic = _topic(INCIDENTS.name)
migrations_topic = _topic(MIGRATIONS.name)
domains_topic = _topic(INCIDENTS_BY_DOMAIN.name)
# What the agents publish to, by topic name (bus.publish.prepare checks each event against its topic).
_outputs = {INCIDENTS.name: incidents_topic} | {
    t.name: _topic(t.name)
    for t in (
        ANOMALIES,
        ANOMALIES_BY_JOB,
        GPU_SAMPLES_BY_JOB,
        DECISIONS,
        ACTIONS,
        DEADLETTER,
        JOB_ATTEMPTS,
        INCIDENTS_BY_DOMAIN,
        MIGRATIONS,
    )
}

# node -> the jobs running there, on every worker: a GlobalTable keyed by job id (each job's changes
# are written in order by the one worker owning its sched.events partition; every worker reads the
# whole changelog). One changelog partition and a recovery buffer of 1: faust's documented remedy for
# a GlobalTable stuck recovering when several workers run. `placement_index` is its node -> jobs view,
# kept from the worker's own writes and every changelog record it reads.
placement_index = PlacementIndex()


async def _placement_record(event: Any) -> None:
    # A changelog record as written (JSON key and value; a deleted key's value is None).
    key, value = event.message.key, event.message.value
    if key:
        placement_index.apply(str(orjson.loads(key)), orjson.loads(value) if value is not None else None)


placements = app.GlobalTable(
    "placements",
    # No key/value type: JSON both ways (str keys, dict values); a type here would be taken for a faust Record.
    partitions=1,
    recovery_buffer_size=1,
    use_partitioner=True,
    on_changelog_event=_placement_record,
    help="job id -> the nodes it runs on (streams/placement.py)",
)


@placements.on_recover
async def _placements_recovered() -> None:
    # Merged, not replaced: what the job events read back (_read_back) added stays, newer wins.
    for job_id, value in placements.items():
        placement_index.apply(job_id, value)
    log.info("placements recovered: %d running jobs", len(placement_index))


signature_detector = SignatureDetector()
hang_detector = HangDetector()
divergence_detector = DivergenceDetector()
throughput_detector = ThroughputDetector()
straggler_detector = StragglerDetector()
xid_detector = XidDetector()
# The clocks the hang and straggler checks judge silence by (streams/watermark.py): every signal
# for the straggler and GPU-idle checks, each job.progress partition for progress silence.
signals_clock = Watermark()
progress_clocks = PartitionClocks()
_behind_logged = 0.0
# GPU lost, NVML/DCGM Xids, DBE ECC, row remaps, NVLink and PCIe bursts, persistent throttle (gpu_health.yaml).
gpu_health_detector = GpuHealthDetector()
# NVSentinel health events (on their node) and NVRx reports (on their job), external_health.yaml.
external_detector = ExternalHealthDetector()
# SXids and hung-task / D-state reports; keeps one open report per node (bounded, see kernel_signatures.yaml).
kernel_text_detector = KernelTextDetector()
# Pre-failure verdicts per GPU (prefailure.yaml): read only while the policy's prediction is enabled.
prefailure_detector = PreFailureDetector()
# The policy's prediction.enabled, as of the last beat of follow_mode_changes (not read per sample).
_prediction_on = False
# InfiniBand / RoCE ports down after being up, link downs, error-counter bursts (net_ports.yaml).
net_port_detector = NetPortDetector()
attributor = Attributor(
    settle_s=SETTINGS.settle_s, collateral_wait_s=SETTINGS.collateral_s, cascade_window_s=SETTINGS.cascade_window_s
)
# Operator mode changes: the API's state file when this host sees it, then mode.changes.
modes = ModeState(BOOTSTRAP, SETTINGS.modes_file)
LIVENESS = health.loop("streams", stale_after_s=60.0)
# job id -> the restarts policy ordered ([action id, time] pairs, streams.policy_store.RestartLedger):
# written by apply_policy for the job's incidents partition, so the changelog partition is the
# job's, and a restarted worker or the one the partition moves to recovers the budget with it.
# use_partitioner: the read-back may write it outside a record; the key's partition is the job's.
restart_budget = app.Table(
    "restart_budget", partitions=PARTITIONS, use_partitioner=True, help="job id -> restarts ordered"
)
policies = PolicyStore(str(SETTINGS.policy) if SETTINGS.policy else None, SETTINGS.mode, modes, restart_budget)
# job id -> its attempt lineage (streams/lineage.py): written by the agents reading the job's
# progress, job states and incidents, all on the job's partition, so it moves with the job.
job_lineage = app.Table("job_lineage", partitions=PARTITIONS, use_partitioner=True, help="job id -> attempt lineage")
lineages = Lineages(job_lineage)
# topology domain -> its recent faults (streams/fleet.py): written by the agent reading the domain's
# partition of incidents.by_domain, so it moves with the domain.
domain_faults = app.Table("domain_faults", partitions=PARTITIONS, use_partitioner=True, help="domain -> recent faults")
correlator = DomainCorrelator(domain_faults)
# job id -> its checkpoint-aligned migration (streams/migration.py): written by the agents reading the
# job's incidents, progress and job states, all on the job's partition, so it moves with the job and
# a pending migration outlives any restart of the worker.
job_migrations = app.Table(
    "migrations", partitions=PARTITIONS, use_partitioner=True, help="job id -> checkpoint-aligned migration"
)
migrations = MigrationBook(job_migrations)
topologies = TopologyCache()


@restart_budget.on_recover
async def _restart_budget_recovered() -> None:
    """After each recovery of the table (start, rebalance): the restarts in the actions topic that
    the table lacks, counted once each (the floor for the embedded broker, docs/scaling.md). Runs
    before the worker judges any incident of the partitions it recovered."""
    since = time.time() - policies.policy.restart_budget.window_h * 3600
    try:
        actions = await asyncio.get_running_loop().run_in_executor(None, read_actions, BOOTSTRAP, since)
    except (KafkaException, TimeoutError) as exc:
        log.error("could not read the actions back (%s): the restart budget is the table's alone", exc)
        return
    log.info("restart budget recovered: %d restarts read back that the table lacked", policies.restore(actions))


@job_migrations.on_recover
async def _migrations_recovered() -> None:
    """After each recovery of the table: the migrations on the topic that the table lacks (the floor
    for the embedded broker, as the restart budget's). Older than the wait bound, a migration has
    ended (or its deadline has passed), so that is as far back as it reads."""
    since = time.time() - policies.policy.prediction.checkpoint_wait_s - 600.0
    try:
        states, incidents = await asyncio.get_running_loop().run_in_executor(None, read_migrations, BOOTSTRAP, since)
    except (KafkaException, TimeoutError) as exc:
        log.error("could not read the migrations back (%s): pending migrations are the table's alone", exc)
        return
    log.info("migrations recovered: %d read back that the table lacked", migrations.restore(states, incidents, owns))


_recovery_lock = asyncio.Lock()
_recovered = False
# The partitions of anomalies.by_job (and so of every job-keyed topic attribution reads) this
# worker was last assigned; None until the first assignment.
_owned: set[int] | None = None
# Cleared while a take-over reads back the history of partitions this worker just received, so
# that neither a record nor a flush runs against half-restored state.
_attribution_open = asyncio.Event()
_attribution_open.set()


def _route_key(group_key: str) -> str:
    """The record key attribution's input has for a group key (a job id, or node:<name>)."""
    return group_key[len("node:") :] if group_key.startswith("node:") else group_key


def _partition_of(key: str) -> int:
    """The partition a job-keyed record of `key` is on (the producers' murmur2 partitioner)."""
    return int((murmur2(key.encode()) & 0x7FFFFFFF) % PARTITIONS)


def owns(group_key: str) -> bool:
    """Whether this worker attributes the group `group_key` (its partition is assigned here)."""
    if _owned is None or group_key == "node:?":
        return True
    return _partition_of(_route_key(group_key)) in _owned


async def _read_back() -> None:
    """Take back the incidents, job placements and pending evidence previous workers published,
    then keep only the groups this worker owns. Safe to repeat: an incident read twice holds its
    job once, an anomaly already held is refused. (The restart budget: its table's recovery.)"""
    now = time.time()
    history = await asyncio.get_running_loop().run_in_executor(
        None, read_history, BOOTSTRAP, now, attributor.hold_s, ALLOCATION_TTL_S
    )
    # A predicted incident holds no job: the failure it foretells is judged as its own incident.
    reactive = [i for i in history.incidents if i.kind == "reactive"]
    holding = attributor.restore(reactive, history.sched, now, history.anomalies)
    for ev in history.sched:  # the placements' floor, as the restart budget's (docs/scaling.md)
        change = placement_change(ev)
        if change is not None and change != "ended":
            placement_index.put(change)
        elif change == "ended" and ev.job_id and (p := placement_index.get(ev.job_id)) and ev.event_time >= p.since:
            placement_index.drop(ev.job_id)
    dropped = attributor.retain(owns)
    log.info(
        "state read back from the topics: %d incidents (%d still holding their job), "
        "%d job states, %d anomalies (%d groups pending here, %d left to other workers), %d undecodable",
        len(history.incidents),
        holding,
        len(history.sched),
        len(history.anomalies),
        attributor.pending(),
        dropped,
        history.undecodable,
    )


async def recover_state() -> None:
    """Before the first record: take back what a previous worker published, so a restart
    neither repeats nor forgets a decision."""
    global _recovered
    async with _recovery_lock:
        if _recovered:
            return
        # Operator modes before the first decision: a worker still in doubt would decide as in
        # monitor mode. Bounded: a missing or slow topic leaves it in doubt (monitor), not stuck.
        deadline = time.monotonic() + 10.0
        while modes.in_doubt and time.monotonic() < deadline:
            await asyncio.get_running_loop().run_in_executor(None, modes.poll)
            await asyncio.sleep(0.1)
        try:
            await _read_back()
        except (KafkaException, TimeoutError) as exc:
            # Stopping here would stop all detection; going on risks one repeated incident
            # (the executor still refuses to repeat an action id). Say so loudly and go on.
            log.error(
                "could not read back the previous worker's state (%s): a fault handled just before this "
                "restart may be reported again",
                exc,
            )
        _recovered = True


async def _take_over(received: set[int]) -> None:
    """Partitions moved here from another worker (it stopped, or the group grew or shrank): read
    back their history, as a restarted worker would, before judging their records."""
    try:
        async with _recovery_lock:
            log.info("partitions %s moved to this worker: reading back their state", sorted(received))
            await _read_back()
    except (KafkaException, TimeoutError) as exc:
        log.error(
            "could not read back the state of partitions %s (%s): a fault in flight may be reported again",
            sorted(received),
            exc,
        )
    finally:
        _attribution_open.set()


@app.on_partitions_assigned.connect
async def _partitions_assigned(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
    """Follow which jobs this worker judges. A group of a job no longer ours is dropped (its new
    owner reads the evidence back); a partition that arrives after the first read-back is taken over."""
    global _owned
    assigned = args[0] if args else kwargs.get("assigned", ())
    parts = {tp.partition for tp in assigned if tp.topic == ANOMALIES_BY_JOB.name}
    received = parts - (_owned or set()) if _owned is not None else set()
    _owned = parts
    # Operators (and the multi-worker tests) read which jobs a worker judges from this line.
    log.info("attributing partitions %s of %d", sorted(parts), PARTITIONS)
    actual = app.consumer.topic_partitions(ANOMALIES_BY_JOB.name)
    if actual and actual != PARTITIONS:
        # Ownership would be computed against the wrong count: groups kept or dropped wrongly.
        log.error(
            "%s has %d partitions but the setting topic_partitions is %d: set TRAINMEDIC_TOPIC_PARTITIONS=%d "
            "(topics are fixed at install); until then this worker may drop or repeat incidents",
            ANOMALIES_BY_JOB.name,
            actual,
            PARTITIONS,
            actual,
        )
    attributor.retain(owns)
    lineages.retain(owns)
    if received and _recovered:
        _attribution_open.clear()
        asyncio.ensure_future(_take_over(received))


async def publish(topic: Topic, event: Event, key: bytes | None = None) -> None:
    """The streams' side of the one publish path (bus.publish): checked, keyed, fitted, counted.
    `key`: the job a repartition topic's record is for (the router's choice)."""
    records, unfit = prepare(topic, event, CLIENT_DEFAULT_MAX_BYTES, key)
    out = _outputs[topic.name]
    for key, payload, _ in records:
        await out.send(key=key, value=payload)
        metrics.PUBLISHED.labels(topic.name).inc()
    for part in unfit:
        await _dead_letter_unfit(topic.name, part.event_id, encode(part))


async def _dead_letter_unfit(topic_name: str, event_id: str, payload: bytes) -> None:
    reason = f"event over the {CLIENT_DEFAULT_MAX_BYTES}-byte message size limit (event {event_id})"
    log.error("dead-lettered %s: %s", topic_name, reason)
    letter = make_dead_letter("streams", topic_name, None, None, reason, payload)
    # A letter is cut to fit (bus.deadletter): it always has one record.
    metrics.DEAD_LETTERS.labels("streams").inc()
    for key, letter_payload, _ in prepare(DEADLETTER, letter, CLIENT_DEFAULT_MAX_BYTES)[0]:
        await _outputs[DEADLETTER.name].send(key=key, value=letter_payload)
        metrics.PUBLISHED.labels(DEADLETTER.name).inc()


# node -> event time of the last GPU sample forwarded to its jobs. The straggler detector keeps one
# reading per node every GPU_SAMPLE_EVERY_S and the hang detector's idle check needs no more, so
# only those are forwarded (a lost GPU at once), each job's gathered into one record every
# BATCH_EVERY_S (streams/gpu_batches.py). GPU health reads every sample.
_forwarded_at: dict[str, float] = {}


def _forward_due(sample: GpuSample) -> bool:
    last = _forwarded_at.get(sample.node)
    due = (
        last is None
        or sample.event_time - last >= GPU_SAMPLE_EVERY_S
        or sample.event_time < last  # a clock set back: start again
        or any(g.lost for g in sample.gpus)
    )
    if due:
        _forwarded_at[sample.node] = sample.event_time
    return due


gpu_batches = GpuBatches()


async def send_gpu_batches(records: list[tuple[str, bytes]]) -> None:
    """Each job's gathered GPU samples, one record per job (keyed by the job)."""
    out = _outputs[GPU_SAMPLES_BY_JOB.name]
    for job, payload in records:
        if not fits(payload, CLIENT_DEFAULT_MAX_BYTES):
            await _dead_letter_unfit(GPU_SAMPLES_BY_JOB.name, f"gpu samples of job {job}", payload)
            continue
        await out.send(key=job.encode(), value=payload)
        metrics.PUBLISHED.labels(GPU_SAMPLES_BY_JOB.name).inc()


def ours(event: Event, agent: str) -> bool:
    """Whether the event is this worker's cluster's. Several clusters may share the topics; each
    cluster's workers (their own consumer group) judge only its events, so job ids never mix."""
    if event.cluster == current_cluster():
        return True
    metrics.FOREIGN.labels(agent, event.cluster).inc()
    return False


# (agent, topic) -> its events counter and record-age gauge: looking a labelled child up on every
# event showed in the worker's profile at fleet scale.
_consumed_children: dict[tuple[str, str], tuple[Any, Any]] = {}


def consumed(agent: str, event: Any) -> None:
    msg = event.message
    children = _consumed_children.get((agent, msg.topic))
    if children is None:
        children = (metrics.EVENTS_IN.labels(agent, msg.topic), metrics.RECORD_AGE.labels(agent, msg.topic))
        _consumed_children[(agent, msg.topic)] = children
    events_in, record_age = children
    events_in.inc()
    health.processed(f"streams.{agent}")
    if msg.timestamp:
        record_age.set(max(0.0, time.time() - msg.timestamp))


async def dead_letter(component: str, event: Any, reason: str) -> None:
    msg = event.message
    payload = event.value if isinstance(event.value, bytes) else bytes(str(event.value), "utf-8")
    log.warning("dead letter from %s@%s/%s: %s", msg.topic, msg.partition, msg.offset, reason)
    metrics.DEAD_LETTERS.labels(component).inc()
    await publish(DEADLETTER, make_dead_letter(component, msg.topic, msg.partition, msg.offset, reason, payload))


async def accept(event: Any, event_type: type[E], agent: str, component: str) -> E | None:
    """The record as its event type when this worker is to judge it; None when it was
    dead-lettered (undecodable) or is another cluster's."""
    got = await accept_as_read(event, event_type, agent, component)
    return None if got is None else got[0]


async def accept_as_read(event: Any, event_type: type[E], agent: str, component: str) -> tuple[E, bytes] | None:
    """As `accept`, with a current-version payload of the record to pass on (schemas.codec.decode_as_read)."""
    consumed(agent, event)
    try:
        decoded, payload = decode_as_read(event_type, event.value)
    except DecodeError as exc:
        await dead_letter(component, event, str(exc))
        return None
    if not ours(decoded, agent):
        return None
    if event.message.topic in NODE_SIGNED_TOPICS and (why := node_refusal(event, decoded)) is not None:
        await dead_letter(component, event, why)
        return None
    return decoded, payload


def node_refusal(event: Any, record: Event) -> str | None:
    """Why a node record (gpu.samples, node.kernel, net.ports) is refused: a signature that is
    not its own node's (another node's key, or the record changed), or none where one is required."""
    headers = event.headers or {}
    node = str(getattr(record, "node", "") or "")
    if NODE_SECRET_ERROR is not None and (NODE_SIGNATURE_HEADER in headers or NODE_SIGNING_REQUIRED):
        return f"{SIGNATURE_INVALID}: record of node {node[:64]!r}: the worker's site_secret is unusable"
    return check_node_signature(
        NODE_SECRET, current_cluster(), headers, event.value, node, required=NODE_SIGNING_REQUIRED
    )


async def accept_signal(event: Any) -> Event | None:
    """A record of detect_signals' topics as its type. On gpu.samples.by_job a single sample is
    also read: a worker of the version before gpu_sample_batch forwarded one per record, and
    during a rolling upgrade both kinds arrive."""
    topic = event.message.topic
    if topic != GPU_SAMPLES_BY_JOB.name:
        return await accept(event, _SIGNAL_TYPES[topic], "detect_signals", "streams.detect_signals")
    consumed("detect_signals", event)
    try:
        batch = decode(GpuSampleBatch, event.value)
    except DecodeError as exc:
        try:
            one = decode(GpuSample, event.value)
        except DecodeError:
            await dead_letter("streams.detect_signals", event, str(exc))
            return None
        job = (event.message.key or b"").decode(errors="replace") or one.node
        batch = GpuSampleBatch(
            event_id=one.event_id, event_time=one.event_time, cluster=one.cluster, job_id=job, samples=[one]
        )
    return batch if ours(batch, "detect_signals") else None


@app.agent(logs_topic)
async def detect_logs(stream: faust.StreamT[bytes]) -> None:
    async for event in stream.events():
        if (batch := await accept(event, LogBatch, "detect_logs", "streams.detect_logs")) is None:
            continue
        for anomaly in signature_detector.detect(batch):
            await publish(ANOMALIES, anomaly)


@app.agent(kernel_topic)
async def detect_kernel(stream: faust.StreamT[bytes]) -> None:
    async for event in stream.events():
        if (kev := await accept(event, KernelEvent, "detect_kernel", "streams.detect_kernel")) is None:
            continue
        for anomaly in [*xid_detector.detect(kev), *kernel_text_detector.detect(kev)]:
            await publish(ANOMALIES, anomaly)


@app.agent(net_topic)
async def detect_net(stream: faust.StreamT[bytes]) -> None:
    """Each node's own InfiniBand / RoCE ports; its anomalies are node-keyed, as the GPU detector's,
    and route_anomalies re-keys them to the jobs on the node."""
    async for event in stream.events():
        if (sample := await accept(event, NetPortSample, "detect_net", "streams.detect_net")) is None:
            continue
        for anomaly in net_port_detector.observe(sample):
            await publish(ANOMALIES, anomaly)


@app.agent(sched_topic)
async def track_placements(stream: faust.StreamT[bytes]) -> None:
    """The placement table, from the scheduler's job events."""
    async for event in stream.events():
        if (ev := await accept(event, SchedEvent, "track_placements", "streams.placements")) is None:
            continue
        change = placement_change(ev)
        if change == "ended" and ev.job_id:
            current = placement_index.get(ev.job_id)
            if current is not None and ev.event_time >= current.since:
                placement_index.drop(ev.job_id)
                del placements[ev.job_id]
        elif change is not None and change != "ended" and placement_index.put(change):
            placements[change.job_id] = change.to_dict()


@app.agent(anomalies_topic)
async def route_anomalies(stream: faust.StreamT[bytes]) -> None:
    """Node-level anomalies (no job: a kernel Xid, a GPU reading, NVSentinel) to attribution,
    re-keyed to each job running on their node; on an idle node, keyed by the node."""
    async for event in stream.events():
        if (anomaly := await accept(event, Anomaly, "route_anomalies", "streams.route")) is None:
            continue
        if anomaly.job_id:
            continue  # already on its job's partition: attribution reads it from `anomalies`
        jobs = placement_index.jobs_on(anomaly.node) if anomaly.node else []
        if not jobs:
            await publish(ANOMALIES_BY_JOB, anomaly, (anomaly.node or anomaly.event_id).encode())
        for job in jobs:
            await publish(ANOMALIES_BY_JOB, anomaly.model_copy(update={"job_id": job}), job.encode())


@app.agent(gpu_topic)
async def detect_gpu(stream: faust.StreamT[bytes]) -> None:
    """GPU health per node; then each sample to the jobs on its node, for their hang and
    straggler detectors."""
    async for event in stream.events():
        if (got := await accept_as_read(event, GpuSample, "detect_gpu", "streams.detect_gpu")) is None:
            continue
        sample, payload = got
        for anomaly in gpu_health_detector.observe(sample):
            await publish(ANOMALIES, anomaly)
        if _prediction_on:
            await predict(sample)
        jobs = placement_index.jobs_on(sample.node)
        if jobs and _forward_due(sample):
            for job in jobs:
                gpu_batches.add(job, sample, payload)
            if GpuBatches.urgent(sample):
                for job in jobs:
                    await send_gpu_batches(gpu_batches.take(job))


async def predict(sample: GpuSample) -> None:
    """Pre-failure verdicts about the sample's GPUs: one predicted incident per job on its node (a
    node running no job has nothing to migrate; its verdicts are not acted on)."""
    for verdict in prefailure_detector.observe(sample):
        for job in placement_index.jobs_on(sample.node):
            placement = placement_index.get(job)
            if placement is not None:
                incident = predicted_incident(verdict, placement, time.time())
                log.info("predicted incident %s job=%s: %s", incident.incident_id, job, incident.explanation)
                await publish(INCIDENTS, incident)


@app.timer(interval=BATCH_EVERY_S)
async def flush_gpu_batches() -> None:
    await send_gpu_batches(gpu_batches.take())


@app.agent(external_topic)
async def detect_external(stream: faust.StreamT[bytes]) -> None:
    async for event in stream.events():
        if (report := await accept(event, HealthEvent, "detect_external", "streams.detect_external")) is None:
            continue
        for anomaly in external_detector.detect(report):
            await publish(ANOMALIES, anomaly)


@app.agent(signals_topic)
async def detect_signals(stream: faust.StreamT[bytes]) -> None:
    """Progress, GPU samples and job states feed the hang and straggler detectors; progress also
    the loss and throughput detectors, which answer at once (they judge the series, not a clock)."""
    async for event in stream.events():
        if (signal := await accept_signal(event)) is None:
            continue
        now = time.time()
        signals_clock.see(min(signal.event_time, now), now)  # a producer clock ahead of ours cannot run it forward
        if isinstance(signal, ProgressBatch):
            progress_clocks.see(event.message.partition, min(signal.event_time, now))
        found: list[Anomaly] = []
        attempts: list[JobAttempt] = []
        if isinstance(signal, ProgressBatch):
            await migrate_at_checkpoint(signal)
            attempts = lineages.observe_progress(signal)
            hang_detector.observe_progress(signal, now)
            straggler_detector.observe_progress(signal, now)
            found = divergence_detector.observe(signal) + throughput_detector.observe(signal)
        elif isinstance(signal, GpuSampleBatch):
            for sample in signal.samples:
                hang_detector.observe_gpu(sample, now)
                straggler_detector.observe_gpu(sample, now)
        elif isinstance(signal, SchedEvent):
            attempts = lineages.observe_sched(signal)
            hang_detector.observe_sched(signal, now)
            straggler_detector.observe_sched(signal, now)
            if signal.kind == "job" and signal.job_id and job_state_kind(signal.state) == "ended":
                # A requeued or finished run starts a new loss and speed history.
                divergence_detector.forget(signal.job_id)
                throughput_detector.forget(signal.job_id)
                if (closed := migrations.forget(signal.job_id, now)) is not None:
                    await publish(MIGRATIONS, closed)
        for anomaly in found:
            await publish(ANOMALIES, anomaly)
        for attempt in attempts:
            await publish(JOB_ATTEMPTS, attempt)


async def migrate_at_checkpoint(batch: ProgressBatch) -> None:
    """A completed save of a job with a pending migration: the job is requeued off the drained node."""
    found = migrations.checkpoint(batch)
    if found is None:
        return
    record, step = found
    now = time.time()
    action = requeue_action(record, now, step)
    incident = migrations.incident(record)
    policies.count_restart(batch.job_id, action.action_id, now)
    saved = f"checkpoint {step}" if step is not None else "a checkpoint (no step stated)"
    if done := migrations.finish(batch.job_id, "requeued", now, f"{saved} saved: requeue off {record['node']}", step):
        log.info("migration %s job=%s: %s", done.migration_id, batch.job_id, done.detail)
        await publish(ACTIONS, action)
        await publish(MIGRATIONS, done)
        for attempt in lineages.ended_by(incident, record["node"]):
            await publish(JOB_ATTEMPTS, attempt)


@app.timer(interval=1.0)
async def expire_migrations() -> None:
    """A migration whose job saved no checkpoint in time falls back: the node stays drained, the job
    runs on, and a failure is handled as any other."""
    now = time.time()
    for job_id in migrations.expired(now):
        if not owns(job_id):
            continue  # another worker's job (a standby copy of its table partition)
        closed = migrations.finish(
            job_id, "fell_back", now, "no completed checkpoint before the deadline: the reactive path stays"
        )
        if closed is not None:
            log.info("migration %s job=%s fell back: %s", closed.migration_id, job_id, closed.detail)
            await publish(MIGRATIONS, closed)


@app.agent(migrations_topic)
async def follow_migrations(stream: faust.StreamT[bytes]) -> None:
    """An operator's cancel (the API resumes the node): the pending migration is dropped unanswered."""
    async for event in stream.events():
        if (record := await accept(event, Migration, "follow_migrations", "streams.migrations")) is None:
            continue
        if record.state != "cancelled" or record.requested_by == "policy":
            continue
        pending = migrations.pending(record.job_id)
        if pending is not None and pending["migration_id"] == record.migration_id:
            migrations.finish(record.job_id, "cancelled", record.event_time, record.detail, by=record.requested_by)
            log.info("migration %s job=%s cancelled by %s", record.migration_id, record.job_id, record.requested_by)


@app.timer(interval=10.0)
async def flush_lineages() -> None:
    # Step counts are written at most this often (a changelog record per job), not per batch.
    lineages.flush()


@app.timer(interval=1.0)
async def follow_mode_changes() -> None:
    global _prediction_on
    _prediction_on = policies.policy.prediction.enabled
    # In a thread: the follower's read blocks up to its poll timeout.
    await asyncio.get_running_loop().run_in_executor(None, modes.poll)
    metrics.MODES_IN_DOUBT.set(1 if modes.in_doubt else 0)
    # Faust starts timers once the worker is fully started (tables recovered, agents running),
    # so this beat is the worker's liveness and its first run the start of its readiness.
    LIVENESS.beat()
    if modes.in_doubt:
        # Fail closed shows: deciding as in monitor mode until the operators' modes are read.
        LIVENESS.set_ready(False, f"operator modes unreadable ({MODE_CHANGES.name}): deciding as monitor")
    else:
        LIVENESS.set_ready(True, "consuming")


@app.timer(interval=2.0)
async def check_signals() -> None:
    global _behind_logged
    wall = time.time()
    # Silence is judged by the newest signal read, so a backlog delays verdicts instead of making them.
    now = signals_clock.judged_now(wall)
    behind = signals_clock.behind_s(wall)
    metrics.SIGNALS_BEHIND.set(behind)
    if behind > 0 and wall - _behind_logged > 60.0:
        _behind_logged = wall
        log.warning("hang and straggler checks %.0f s behind the wall clock: reading a backlog", behind)

    def progress_now(job_id: str) -> float:
        return progress_clocks.judged_now(_partition_of(job_id), wall, signals_clock)

    for anomaly in hang_detector.check(now, progress_now) + straggler_detector.check(now):
        await publish(ANOMALIES, anomaly)


@app.agent(attribution_topic)
async def attribute(stream: faust.StreamT[bytes]) -> None:
    await recover_state()
    async for event in stream.events():
        if not _attribution_open.is_set():
            await _attribution_open.wait()
        topic = event.message.topic
        evidence_type: type[Event] = SchedEvent if topic == SCHED_EVENTS.name else Anomaly
        if (evidence := await accept(event, evidence_type, "attribute", "streams.attribute")) is None:
            continue
        if isinstance(evidence, Anomaly) and topic == ANOMALIES.name and not evidence.job_id:
            continue  # node-level: it arrives re-keyed on anomalies.by_job (route_anomalies)
        if isinstance(evidence, SchedEvent):
            attributor.observe_sched(evidence, time.time())
        elif isinstance(evidence, Anomaly):
            attributor.add(evidence, time.time())


@app.timer(interval=0.2)
async def publish_incidents() -> None:
    if not _attribution_open.is_set():
        return  # a take-over is reading back state: flush when it is whole
    now = time.time()
    for incident in attributor.flush(now):
        metrics.INCIDENTS.labels(incident.category).inc()
        metrics.DETECTION_LATENCY.observe(max(0.0, incident.event_time - incident.first_signal_time))
        log.info(
            "incident %s job=%s category=%s culprit=%s",
            incident.incident_id,
            incident.job_id,
            incident.category,
            incident.culprit_node,
        )
        await publish(INCIDENTS, incident)
    metrics.PENDING_GROUPS.set(attributor.pending())


@app.agent(incidents_topic)
async def apply_policy(stream: faust.StreamT[bytes]) -> None:
    await recover_state()
    async for event in stream.events():
        if (incident := await accept(event, Incident, "apply_policy", "streams.policy")) is None:
            continue
        if incident.kind == "predicted":
            await apply_prediction(incident)
            continue
        if (pending := migrations.pending(incident.job_id)) is not None:
            if answered_by(pending, incident):
                # gpu_health's own reading of the condition the migration answers: nothing more to do.
                mode = policies.policy.mode_for(incident.partition, incident.category)
                await publish(DECISIONS, absorbed_decision(pending, incident, mode, time.time()))
                continue
            job = str(pending["incident"]["job_id"])
            if (superseded := migrations.finish(job, "superseded", time.time(), _superseded(incident))) is not None:
                await publish(MIGRATIONS, superseded)
        decision, action = policies.decide(incident, time.time(), lineages.history(incident.job_id))
        metrics.DECISIONS.labels(decision.action, "action" if decision.executed else "recommendation").inc()
        if incident.isolate and action is None:
            # An isolation that is not carried out says why (culprit unresolved or outside the job).
            log.info(
                "decision %s job=%s: %s (%s)", decision.decision_id, decision.job_id, decision.rule, decision.reason
            )
        await publish(DECISIONS, decision)
        if action is not None:
            await publish(ACTIONS, action)
        if decision.action in (*RESTARTS, *STOPS):
            # The incident ends the attempt whether policy restarts the job or recommends it (an
            # operator's approval, Slurm's own requeue): the same-cause rule needs the cause either way.
            excluded = action.node if action is not None and action.action == "drain_and_requeue" else None
            for attempt in lineages.ended_by(incident, excluded):
                await publish(JOB_ATTEMPTS, attempt)
        fleet = policies.policy.fleet
        if watched(fleet, incident):
            # Spans jobs: counted by the worker owning each of the node's domains (correlate_domains).
            for domain in topologies.get(fleet).domains_of(incident.culprit_node):
                await publish(INCIDENTS_BY_DOMAIN, incident, domain.encode())


def _superseded(incident: Incident) -> str:
    return f"{incident.category} incident {incident.incident_id} before the checkpoint: the reactive path acts"


async def apply_prediction(incident: Incident) -> None:
    """A predicted incident: drain now and wait for the job's next checkpoint, or what policy says
    instead (monitor mode: a recommendation)."""
    if migrations.seen(incident.job_id, incident.culprit_node):
        return  # this job already migrates (or migrated) off this node: a verdict raised again
    known, last = lineages.checkpoints(incident.job_id)
    now = time.time()
    decision, action, migrate = policies.decide_predicted(incident, now, known)
    metrics.DECISIONS.labels(decision.action, "action" if decision.executed else "recommendation").inc()
    log.info("decision %s job=%s (predicted): %s", decision.decision_id, decision.job_id, decision.rule)
    await publish(DECISIONS, decision)
    if action is not None:
        await publish(ACTIONS, action)
    if migrate and action is not None:
        wait_s = policies.policy.prediction.checkpoint_wait_s
        if (begun := migrations.begin(incident, decision, wait_s, last, now)) is not None:
            await publish(MIGRATIONS, begun)


@app.agent(domains_topic)
async def correlate_domains(stream: faust.StreamT[bytes]) -> None:
    """Node incidents by topology domain: several nodes of one domain failing together are one
    fleet incident on the shared component (streams/fleet.py)."""
    async for event in stream.events():
        if (incident := await accept(event, Incident, "correlate_domains", "streams.fleet")) is None:
            continue
        domain = (event.message.key or b"").decode(errors="replace")
        fleet = policies.policy.fleet
        nodes = topologies.get(fleet).nodes_of.get(domain, [])
        if domain and nodes and (found := correlator.observe(domain, incident, fleet, nodes)) is not None:
            log.info("fleet incident %s on %s: %s", found.incident_id, domain, found.explanation)
            await publish(INCIDENTS, found)


def main() -> None:
    app.main()


if __name__ == "__main__":
    main()
