"""The Faust app: detection, attribution and policy agents.

Records travel as raw bytes and are decoded with schemas.codec, so schemas/
stays the one source of truth for event types; they are published through
bus.publish.prepare. Settings come from the one settings model
(trainmedic.settings: TRAINMEDIC_* environment, then the config file), which
`trainmedic config show` prints.
Run: python -m trainmedic.streams_worker worker --without-web -l info
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiokafka  # type: ignore[import-untyped]
import faust
from confluent_kafka import KafkaException

from bus import health
from bus.config import security
from bus.deadletter import make_dead_letter
from bus.publish import CLIENT_DEFAULT_MAX_BYTES, prepare
from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    Anomaly,
    Event,
    GpuSample,
    HealthEvent,
    Incident,
    KernelEvent,
    LogBatch,
    ProgressBatch,
    SchedEvent,
)
from schemas.ids import cluster_scoped, current_cluster
from schemas.topics import (
    ACTIONS,
    ANOMALIES,
    DEADLETTER,
    DECISIONS,
    DEFAULT_PARTITIONS,
    GPU_SAMPLES,
    HEALTH_EXTERNAL,
    INCIDENTS,
    JOB_LOGS,
    JOB_PROGRESS,
    MODE_CHANGES,
    NODE_KERNEL,
    SCHED_EVENTS,
    Topic,
)
from streams import metrics
from streams.attribution import ALLOCATION_TTL_S, Attributor
from streams.credentials import faust_credentials
from streams.detectors.divergence import DivergenceDetector
from streams.detectors.external import ExternalHealthDetector
from streams.detectors.gpu_health import GpuHealthDetector
from streams.detectors.hang import HangDetector, job_state_kind
from streams.detectors.kernel_text import KernelTextDetector
from streams.detectors.signatures import SignatureDetector
from streams.detectors.straggler import StragglerDetector
from streams.detectors.throughput import ThroughputDetector
from streams.detectors.xid import XidDetector
from streams.modes import ModeState
from streams.policy_store import PolicyStore
from streams.recovery import read_history
from trainmedic.settings import Settings
from trainmedic.settings import apply as apply_settings

log = logging.getLogger("trainmedic.streams")
E = TypeVar("E", bound=Event)

# The one settings model (trainmedic.settings): environment, then the config file. The worker
# runs as `python -m trainmedic.streams_worker worker`, which has no flags of ours.
SETTINGS = Settings.load()
apply_settings(SETTINGS)
BOOTSTRAP = SETTINGS.bootstrap or "127.0.0.1:9092"
FETCH_MAX_WAIT_MS = SETTINGS.fetch_max_wait_ms


def _short_fetch_wait() -> None:
    """Faust hard-codes aiokafka's fetch_max_wait_ms=1500. A broker that does not
    answer a fetch as soon as data arrives then adds up to 1.5 s per hop, and a fault
    crosses three hops (signal -> anomaly -> incident -> decision). Cap it."""
    original = aiokafka.AIOKafkaConsumer.__init__

    def init(self: aiokafka.AIOKafkaConsumer, *args: Any, **kwargs: Any) -> None:
        kwargs["fetch_max_wait_ms"] = min(int(kwargs.get("fetch_max_wait_ms", 500)), FETCH_MAX_WAIT_MS)
        original(self, *args, **kwargs)

    aiokafka.AIOKafkaConsumer.__init__ = init  # type: ignore[method-assign]


_short_fetch_wait()

app = faust.App(
    cluster_scoped(SETTINGS.streams_id),
    broker=",".join(f"kafka://{h}" for h in BOOTSTRAP.split(",")),
    broker_credentials=faust_credentials(security()),
    store="memory://",
    topic_partitions=DEFAULT_PARTITIONS,
    consumer_auto_offset_reset="earliest",
    # Without these, a worker start takes ~32 s on the embedded broker.
    broker_session_timeout=6,
    broker_heartbeat_interval=1,
    broker_rebalance_timeout=20,
    web_enabled=False,
    datadir=str(SETTINGS.streams_data_dir),
)


def _topic(*names: str) -> Any:
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


logs_topic = _topic(JOB_LOGS.name)
signals_topic = _topic(JOB_PROGRESS.name, GPU_SAMPLES.name, SCHED_EVENTS.name)
_SIGNAL_TYPES: dict[str, type[Event]] = {
    JOB_PROGRESS.name: ProgressBatch,
    GPU_SAMPLES.name: GpuSample,
    SCHED_EVENTS.name: SchedEvent,
}
kernel_topic = _topic(NODE_KERNEL.name)
external_topic = _topic(HEALTH_EXTERNAL.name)
attribution_topic = _topic(ANOMALIES.name, SCHED_EVENTS.name)
incidents_topic = _topic(INCIDENTS.name)
# What the agents publish to, by topic name (bus.publish.prepare checks each event against its topic).
_outputs = {INCIDENTS.name: incidents_topic} | {
    t.name: _topic(t.name) for t in (ANOMALIES, DECISIONS, ACTIONS, DEADLETTER)
}

signature_detector = SignatureDetector()
hang_detector = HangDetector()
divergence_detector = DivergenceDetector()
throughput_detector = ThroughputDetector()
straggler_detector = StragglerDetector()
xid_detector = XidDetector()
# GPU lost, NVML/DCGM Xids, DBE ECC, row remaps, NVLink and PCIe bursts, persistent throttle (gpu_health.yaml).
gpu_health_detector = GpuHealthDetector()
# NVSentinel health events (on their node) and NVRx reports (on their job), external_health.yaml.
external_detector = ExternalHealthDetector()
# SXids and hung-task / D-state reports; keeps one open report per node (bounded, see kernel_signatures.yaml).
kernel_text_detector = KernelTextDetector()
attributor = Attributor(settle_s=SETTINGS.settle_s, collateral_wait_s=SETTINGS.collateral_s)
# Operator mode changes: the API's state file when this host sees it, then mode.changes.
modes = ModeState(BOOTSTRAP, SETTINGS.modes_file)
LIVENESS = health.loop("streams", stale_after_s=60.0)
policies = PolicyStore(str(SETTINGS.policy) if SETTINGS.policy else None, SETTINGS.mode, modes)


_recovery_lock = asyncio.Lock()
_recovered = False


async def recover_state() -> None:
    """Before the first record: take back the incidents, restarts and job placements that a
    previous worker published, so a restart neither repeats nor forgets a decision."""
    global _recovered
    async with _recovery_lock:
        if _recovered:
            return
        now = time.time()
        window_s = policies.policy.restart_budget.window_h * 3600
        try:
            history = await asyncio.get_running_loop().run_in_executor(
                None, read_history, BOOTSTRAP, now, attributor.hold_s, window_s, ALLOCATION_TTL_S
            )
        except (KafkaException, TimeoutError) as exc:
            # Stopping here would stop all detection; going on risks one repeated incident
            # (the executor still refuses to repeat an action id). Say so loudly and go on.
            log.error(
                "could not read back the previous worker's state (%s): a fault handled just before this "
                "restart may be reported again",
                exc,
            )
            _recovered = True
            return
        # Operator modes before the first decision: a worker still in doubt would decide as in
        # monitor mode. Bounded: a missing or slow topic leaves it in doubt (monitor), not stuck.
        deadline = time.monotonic() + 10.0
        while modes.in_doubt and time.monotonic() < deadline:
            await asyncio.get_running_loop().run_in_executor(None, modes.poll)
            await asyncio.sleep(0.1)
        holding = attributor.restore(history.incidents, history.sched, now, history.anomalies)
        restarts = policies.restore(history.actions)
        _recovered = True
        log.info(
            "state recovered from the topics: %d incidents (%d still holding their job), %d restarts, "
            "%d job states, %d anomalies (%d still pending), %d undecodable",
            len(history.incidents),
            holding,
            restarts,
            len(history.sched),
            len(history.anomalies),
            attributor.pending(),
            history.undecodable,
        )


async def publish(topic: Topic, event: Event) -> None:
    """The streams' side of the one publish path (bus.publish): checked, keyed, fitted, counted."""
    records, unfit = prepare(topic, event, CLIENT_DEFAULT_MAX_BYTES)
    out = _outputs[topic.name]
    for key, payload, _ in records:
        await out.send(key=key, value=payload)
        metrics.PUBLISHED.labels(topic.name).inc()
    for part in unfit:
        reason = f"event over the {CLIENT_DEFAULT_MAX_BYTES}-byte message size limit (event {part.event_id})"
        log.error("dead-lettered %s: %s", topic.name, reason)
        letter = make_dead_letter("streams", topic.name, None, None, reason, encode(part))
        # A letter is cut to fit (bus.deadletter): it always has one record.
        metrics.DEAD_LETTERS.labels("streams").inc()
        for key, payload, _ in prepare(DEADLETTER, letter, CLIENT_DEFAULT_MAX_BYTES)[0]:
            await _outputs[DEADLETTER.name].send(key=key, value=payload)
            metrics.PUBLISHED.labels(DEADLETTER.name).inc()


def ours(event: Event, agent: str) -> bool:
    """Whether the event is this worker's cluster's. Several clusters may share the topics; each
    cluster's workers (their own consumer group) judge only its events, so job ids never mix."""
    if event.cluster == current_cluster():
        return True
    metrics.FOREIGN.labels(agent, event.cluster).inc()
    return False


def consumed(agent: str, event: Any) -> None:
    msg = event.message
    metrics.EVENTS_IN.labels(agent, msg.topic).inc()
    health.processed(f"streams.{agent}")
    if msg.timestamp:
        metrics.RECORD_AGE.labels(agent, msg.topic).set(max(0.0, time.time() - msg.timestamp))


async def dead_letter(component: str, event: Any, reason: str) -> None:
    msg = event.message
    payload = event.value if isinstance(event.value, bytes) else bytes(str(event.value), "utf-8")
    log.warning("dead letter from %s@%s/%s: %s", msg.topic, msg.partition, msg.offset, reason)
    metrics.DEAD_LETTERS.labels(component).inc()
    await publish(DEADLETTER, make_dead_letter(component, msg.topic, msg.partition, msg.offset, reason, payload))


async def accept(event: Any, event_type: type[E], agent: str, component: str) -> E | None:
    """The record as its event type when this worker is to judge it; None when it was
    dead-lettered (undecodable) or is another cluster's."""
    consumed(agent, event)
    try:
        decoded = decode(event_type, event.value)
    except DecodeError as exc:
        await dead_letter(component, event, str(exc))
        return None
    return decoded if ours(decoded, agent) else None


@app.agent(logs_topic)
async def detect_logs(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
    async for event in stream.events():
        if (batch := await accept(event, LogBatch, "detect_logs", "streams.detect_logs")) is None:
            continue
        for anomaly in signature_detector.detect(batch):
            await publish(ANOMALIES, anomaly)
        yield None


@app.agent(kernel_topic)
async def detect_kernel(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
    async for event in stream.events():
        if (kev := await accept(event, KernelEvent, "detect_kernel", "streams.detect_kernel")) is None:
            continue
        for anomaly in [*xid_detector.detect(kev), *kernel_text_detector.detect(kev)]:
            await publish(ANOMALIES, anomaly)
        yield None


@app.agent(external_topic)
async def detect_external(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
    async for event in stream.events():
        if (report := await accept(event, HealthEvent, "detect_external", "streams.detect_external")) is None:
            continue
        for anomaly in external_detector.detect(report):
            await publish(ANOMALIES, anomaly)
        yield None


@app.agent(signals_topic)
async def detect_signals(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
    """Progress, GPU samples and job states feed the hang and straggler detectors; progress also
    the loss and throughput detectors, which answer at once (they judge the series, not a clock)."""
    async for event in stream.events():
        signal_type = _SIGNAL_TYPES[event.message.topic]
        if (signal := await accept(event, signal_type, "detect_signals", "streams.detect_signals")) is None:
            continue
        now = time.time()
        found: list[Anomaly] = []
        if isinstance(signal, ProgressBatch):
            hang_detector.observe_progress(signal, now)
            straggler_detector.observe_progress(signal, now)
            found = divergence_detector.observe(signal) + throughput_detector.observe(signal)
        elif isinstance(signal, GpuSample):
            hang_detector.observe_gpu(signal, now)
            straggler_detector.observe_gpu(signal, now)
            found = gpu_health_detector.observe(signal)
        elif isinstance(signal, SchedEvent):
            hang_detector.observe_sched(signal, now)
            straggler_detector.observe_sched(signal, now)
            if signal.kind == "job" and signal.job_id and job_state_kind(signal.state) == "ended":
                # A requeued or finished run starts a new loss and speed history.
                divergence_detector.forget(signal.job_id)
                throughput_detector.forget(signal.job_id)
        for anomaly in found:
            await publish(ANOMALIES, anomaly)
        yield None


@app.timer(interval=1.0)
async def follow_mode_changes() -> None:
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
    now = time.time()
    for anomaly in hang_detector.check(now) + straggler_detector.check(now):
        await publish(ANOMALIES, anomaly)


@app.agent(attribution_topic)
async def attribute(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
    await recover_state()
    async for event in stream.events():
        evidence_type: type[Event] = SchedEvent if event.message.topic == SCHED_EVENTS.name else Anomaly
        if (evidence := await accept(event, evidence_type, "attribute", "streams.attribute")) is None:
            continue
        if isinstance(evidence, SchedEvent):
            attributor.observe_sched(evidence, time.time())
        elif isinstance(evidence, Anomaly):
            attributor.add(evidence, time.time())
        yield None


@app.timer(interval=0.2)
async def publish_incidents() -> None:
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
async def apply_policy(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
    await recover_state()
    async for event in stream.events():
        if (incident := await accept(event, Incident, "apply_policy", "streams.policy")) is None:
            continue
        decision, action = policies.decide(incident, time.time())
        metrics.DECISIONS.labels(decision.action, "action" if decision.executed else "recommendation").inc()
        if incident.isolate and action is None:
            # An isolation that is not carried out says why (culprit unresolved or outside the job).
            log.info(
                "decision %s job=%s: %s (%s)", decision.decision_id, decision.job_id, decision.rule, decision.reason
            )
        await publish(DECISIONS, decision)
        if action is not None:
            await publish(ACTIONS, action)
        yield None


def main() -> None:
    app.main()


if __name__ == "__main__":
    main()
