"""The node agent: carries out the executor's commands on its own GPU node (topic node.commands).

One kind today, `gpu_reset`: the executor asks for it once it has drained the node for a fault
whose NVIDIA resolution bucket is RESET_GPU (policy `remediation`). The agent resets the GPU once
nothing runs on the node, checks through NVML that the GPU is back, and publishes what it did on
node.command.results (audited in `node_commands`). The node stays drained: it returns to service
through its health check (`trainmedic nodes resume`, or the automatic return to service).

Fail closed, at every step:
- a command is carried out at most once: its id is written to the state folder before the reset
  command starts, and the results on node.command.results are read back at start; a command found
  begun but never finished (the agent died during the reset) is reported failed, never run again;
- the node must still be drained for the command's incident (Slurm's reason names it): resumed, or
  drained for something else since, and the command is refused - the node is not ours any more;
- the node must be idle: no job on it per Slurm (squeue, and the node's own state IDLE) and no
  compute, graphics or MPS process on any of its GPUs per NVML. Whatever cannot be read counts as
  busy. Still busy after the idle timeout: refused, saying what was seen last;
- the Slurm and NVML look that says go is the one right before the reset command starts: a node
  resumed or drained for something else while the command waited is refused, never reset;
- after the reset command exits 0, the GPU must answer NVML again at its index with the PCI bus
  id it had before; else the result is `failed` with the command's output.

Asked to stop (SIGTERM): before the reset began, the agent stops at once and resets nothing (the
command is delivered again at the next start). Once it began, the reset command and the
verification after it are carried to their end, each within its own timeout (`reset_timeout_s`,
`verify_timeout_s`), and the real outcome is reported before the agent stops: a GPU left half
reset by a killed nvidia-smi, or reported `failed` while it was coming back, helps nobody. Whoever
stops the agent must give it that long (systemd TimeoutStopSec, the chart's
terminationGracePeriodSeconds).

NVML is opened only for each look and closed again: a GPU reset is refused while any process
holds the GPU, an NVML client included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from bus import health
from bus.consume import read_records
from bus.deadletter import make_dead_letter
from bus.publish import NotDelivered, Publisher
from bus.watchdog import WatchedConsumer
from schemas.codec import DecodeError, decode, encode
from schemas.errors import ConfigError, Unavailable
from schemas.events import NodeCommand, NodeCommandResult, incident_in_reason
from schemas.ids import cluster_scoped, current_cluster, stable_id
from schemas.topics import DEADLETTER, NODE_COMMAND_RESULTS, NODE_COMMANDS
from sinks import metrics
from slurmio import SQUEUE_ALL, JobInfo, NodeInfo, Runner, SlurmCommandError, SlurmFormatError, show_node
from slurmio.hostlist import HostlistError, expand_hostlist
from slurmio.records import FINISHED_JOB_STATES
from slurmio.squeue import read_jobs

log = logging.getLogger("trainmedic.node_agent")

GPU = "{gpu}"
DEFAULT_RESET = ("nvidia-smi", "--gpu-reset", "-i", GPU)
DEFAULT_RESET_ALL = ("nvidia-smi", "--gpu-reset")
OUTPUT_TAIL = 2000

# A job in one of these (Slurm's base states) no longer holds its nodes, unless a flag below says
# it is still leaving them.
_OFF_NODE = FINISHED_JOB_STATES | {"PENDING"}
_LEAVING = frozenset({"COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "STOPPED", "RESIZING"})


class NvmlUnavailable(Unavailable, RuntimeError):
    """NVML cannot be opened on this host: the agent cannot judge a GPU, so it does not start."""


class ResetCommandError(ConfigError, ValueError):
    pass


def parse_argv(text: str, what: str, needs_gpu: bool) -> tuple[str, ...]:
    """A reset command line as words (no shell). The one-GPU command must say where the index goes
    ({gpu}); the every-GPU one must not (it has no index to put there)."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:
        raise ResetCommandError(f"{what} {text!r}: {exc}") from None
    if not words:
        raise ResetCommandError(f"{what}: empty")
    named = any(GPU in w for w in words)
    if needs_gpu and not named:
        raise ResetCommandError(
            f"{what} {text!r}: it must name the GPU as {GPU} (e.g. nvidia-smi --gpu-reset -i {GPU})"
        )
    if not needs_gpu and named:
        raise ResetCommandError(f"{what} {text!r}: it resets every GPU, there is no {GPU} to put in it")
    return words


@dataclass(frozen=True)
class AgentSettings:
    node: str
    state_dir: Path
    reset_command: tuple[str, ...] = DEFAULT_RESET
    reset_all_command: tuple[str, ...] = DEFAULT_RESET_ALL
    idle_timeout_s: float = 1800.0
    reset_timeout_s: float = 300.0
    # How long the GPU may take to answer NVML again after the reset command returned, and how
    # often NVML is asked meanwhile.
    verify_timeout_s: float = 60.0
    verify_interval_s: float = 1.0
    poll_interval_s: float = 10.0
    slurm_timeout_s: float = 30.0
    group: str = "trainmedic-node-agent"

    def argv(self, gpu: int | None) -> list[str]:
        if gpu is None:
            return list(self.reset_all_command)
        return [w.replace(GPU, str(gpu)) for w in self.reset_command]

    @property
    def consumer_group(self) -> str:
        # One group per node: every agent reads every command, and skips the other nodes'.
        return cluster_scoped(f"{self.group}-{self.node}")


# -- NVML ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuView:
    """The node's GPUs as NVML answered one look: PCI bus id by index, who uses them, what could
    not be read (each a reason to wait)."""

    bus_ids: dict[int, str] = field(default_factory=dict)
    users: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class GpuProbe:
    """NVML (the `pynvml` module of nvidia-ml-py, or a stand-in with its interface), opened for
    each look and closed after it."""

    def __init__(self, nvml: Any | None = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(
                    f"NVML is not available on this host: its Python bindings (nvidia-ml-py) cannot be imported ({exc})"
                ) from None
            nvml = pynvml
        self.nvml: Any = nvml

    @contextlib.contextmanager
    def _opened(self) -> Iterator[Any]:
        self.nvml.nvmlInit()
        try:
            yield self.nvml
        finally:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()

    def check(self) -> int:
        """The GPU count; NvmlUnavailable saying why when NVML cannot be opened."""
        try:
            with self._opened() as nv:
                return int(nv.nvmlDeviceGetCount())
        except self.nvml.NVMLError as exc:
            raise NvmlUnavailable(
                f"NVML is not available on this host ({exc}): the node agent needs the NVIDIA driver's "
                "libnvidia-ml.so.1 to tell whether a GPU is in use and back after a reset"
            ) from None

    def look(self) -> GpuView:
        """Every GPU's bus id and users. Anything NVML does not answer is a problem, not an absence."""
        bus_ids: dict[int, str] = {}
        users: list[str] = []
        problems: list[str] = []
        modes = (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ("MPS", "nvmlDeviceGetMPSComputeRunningProcesses"),
        )
        try:
            with self._opened() as nv:
                for index in range(int(nv.nvmlDeviceGetCount())):
                    try:
                        handle = nv.nvmlDeviceGetHandleByIndex(index)
                        bus_ids[index] = _text(nv.nvmlDeviceGetPciInfo(handle).busId)
                    except nv.NVMLError as exc:
                        problems.append(f"GPU {index} does not answer NVML ({exc})")
                        continue
                    for mode, fn in modes:
                        try:
                            procs = getattr(nv, fn)(handle)
                        except nv.NVMLError as exc:
                            if mode == "MPS" and exc.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NOT_FOUND):
                                continue  # a GPU without MPS has no MPS clients
                            problems.append(f"GPU {index}: {mode} processes not readable ({exc})")
                            continue
                        except Exception as exc:  # e.g. the bindings' NVMLLibraryMismatchError: doubt
                            problems.append(f"GPU {index}: {mode} processes not readable ({type(exc).__name__}: {exc})")
                            continue
                        users += [f"GPU {index}: {mode} process {p.pid}" for p in procs]
        except self.nvml.NVMLError as exc:
            problems.append(f"NVML does not answer ({exc})")
        return GpuView(bus_ids, tuple(users), tuple(problems))


def back_after_reset(before: GpuView, after: GpuView, gpu: int | None) -> str | None:
    """Why the reset GPU(s) are not back as they were (None: they are): present at the same index with
    the same PCI bus id, readable through NVML."""
    wanted = [gpu] if gpu is not None else sorted(before.bus_ids)
    if not wanted:
        return "no GPU was seen before the reset"
    for index in wanted:
        was, now = before.bus_ids.get(index), after.bus_ids.get(index)
        if now is None:
            said = "; ".join(p for p in after.problems if f"GPU {index} " in p or "NVML does not" in p)
            return f"GPU {index} ({was}) does not answer NVML after the reset" + (f": {said}" if said else "")
        if now != was:
            return f"GPU {index} is {now} after the reset, was {was}: not the same GPU"
    return None


# -- Slurm -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmView:
    """The node as Slurm sees it (None: unknown to slurmctld) and the jobs still on it."""

    node: NodeInfo | None
    jobs: tuple[str, ...] = ()


def jobs_on(node: str, jobs: Iterable[JobInfo]) -> tuple[str, ...]:
    """The jobs holding `node`: running, suspended or still leaving it. A job whose nodes cannot be
    read counts as holding it."""
    out = []
    for job in jobs:
        try:
            if node not in expand_hostlist(job.nodes):
                continue
        except HostlistError:
            out.append(job.job_id)
            continue
        words = {job.state, job.base_state, *job.state_flags}
        if words & _LEAVING or not (job.base_state in _OFF_NODE or job.state in _OFF_NODE):
            out.append(job.job_id)
    return tuple(sorted(out, key=lambda j: (len(j), j)))


def read_slurm(runner: Runner, node: str, timeout: float) -> SlurmView:
    """Through slurmio: the jobs (squeue; its data parser tells how to read the node) and the node."""
    doc = read_jobs(runner([*SQUEUE_ALL, f"--nodelist={node}"], timeout))
    info = show_node(runner, node, timeout, doc.parser)
    return SlurmView(info, jobs_on(node, doc.jobs.values()))


# -- the judgement ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    go: bool = False
    refuse: str | None = None  # never: the node is not ours to reset any more
    wait: str | None = None  # not yet


def judge_node(command: NodeCommand, slurm: SlurmView) -> Verdict:
    """Slurm's part: the node still drained for the command's incident, and nothing on it."""
    n = slurm.node
    node = command.node
    if n is None:
        return Verdict(refuse=f"Slurm does not know node {node}")
    if not n.drained:
        return Verdict(
            refuse=f"{node} is not drained any more ({'+'.join([n.state, *n.flags])}): it was returned to service"
        )
    owner = incident_in_reason(n.reason)
    if owner != command.incident_id:
        return Verdict(
            refuse=f"{node} is drained for {owner or 'another reason'} now (reason {n.reason!r}), not for "
            f"{command.incident_id}"
        )
    if slurm.jobs:
        return Verdict(wait=f"job(s) {', '.join(slurm.jobs)} still on {node} per Slurm")
    if n.state != "IDLE" or set(n.flags) - {"DRAIN"}:
        return Verdict(wait=f"{node} is {'+'.join([n.state, *n.flags])} per Slurm, not IDLE+DRAIN")
    return Verdict(go=True)


def judge_gpus(command: NodeCommand, gpus: GpuView) -> Verdict:
    """NVML's part: the GPU to reset is there, and no process uses any GPU of the node (a reset of
    one GPU may take its NVLink peers along)."""
    if gpus.problems:
        return Verdict(wait="; ".join(gpus.problems))
    if not gpus.bus_ids:
        return Verdict(refuse=f"NVML sees no GPU on {command.node}")
    if command.gpu is not None and command.gpu not in gpus.bus_ids:
        return Verdict(refuse=f"GPU {command.gpu} is not on {command.node} per NVML (GPUs {sorted(gpus.bus_ids)})")
    if gpus.users:
        return Verdict(wait="; ".join(gpus.users))
    return Verdict(go=True)


def judge(command: NodeCommand, slurm: SlurmView, gpus: GpuView) -> Verdict:
    """Whether the command may be carried out now, must wait, or must never be."""
    verdict = judge_node(command, slurm)
    return judge_gpus(command, gpus) if verdict.go else verdict


# -- what was done: the state folder ---------------------------------------------------------------


Stage = Literal["started", "finished", "published"]


class CommandLog:
    """The commands this agent began, finished and reported, one JSON object a line, each written and
    flushed to disk before the step it records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stage: dict[str, Stage] = {}
        self._result: dict[str, NodeCommandResult] = {}
        self._command: dict[str, NodeCommand] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes() if path.exists() else b""
        # A torn last line (power lost while writing): the next record starts on a line of its own.
        self._torn = bool(data) and not data.endswith(b"\n")
        if data:
            for lineno, line in enumerate(data.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    self._apply(orjson.loads(line))
                except (ValueError, KeyError, DecodeError) as exc:
                    # Torn: that step was not done.
                    log.warning("%s line %d unreadable, skipped: %s", path, lineno, exc)

    def _apply(self, record: dict[str, Any]) -> None:
        cid, stage = str(record["command_id"]), record["stage"]
        if stage == "started":
            self._command[cid] = decode(NodeCommand, orjson.dumps(record["command"]))
        elif stage == "finished":
            self._result[cid] = decode(NodeCommandResult, orjson.dumps(record["result"]))
        elif stage != "published":
            raise KeyError(stage)
        if self._rank(stage) > self._rank(self._stage.get(cid)):
            self._stage[cid] = stage

    @staticmethod
    def _rank(stage: Stage | None) -> int:
        return {None: 0, "started": 1, "finished": 2, "published": 3}[stage]

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("ab") as f:
            f.write((b"\n" if self._torn else b"") + orjson.dumps(record) + b"\n")
            self._torn = False
            f.flush()
            os.fsync(f.fileno())
        self._apply(record)

    def stage(self, command_id: str) -> Stage | None:
        return self._stage.get(command_id)

    def result(self, command_id: str) -> NodeCommandResult | None:
        return self._result.get(command_id)

    def interrupted(self) -> list[NodeCommand]:
        """Commands begun and never finished: the agent stopped while their reset ran."""
        return [self._command[c] for c, s in self._stage.items() if s == "started" and c in self._command]

    def started(self, command: NodeCommand) -> None:
        self._write({"command_id": command.command_id, "stage": "started", "command": orjson.loads(encode(command))})

    def finished(self, result: NodeCommandResult) -> None:
        self._write({"command_id": result.command_id, "stage": "finished", "result": orjson.loads(encode(result))})

    def published(self, result: NodeCommandResult) -> None:
        """The result is on node.command.results (written by this agent, or read back from there)."""
        if self._stage.get(result.command_id) == "published":
            return
        if result.command_id not in self._result:
            self._write({"command_id": result.command_id, "stage": "finished", "result": orjson.loads(encode(result))})
        self._write({"command_id": result.command_id, "stage": "published"})


# -- the reset command -----------------------------------------------------------------------------


def run_reset(argv: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
    """Run the reset command (never through a shell): its exit status (None: it did not finish in
    time and was killed, or could not be started) and the tail of its output."""
    try:
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = _text(exc.output or b"")
        return None, f"timed out after {timeout_s:g} s and was killed; output: {out[-OUTPUT_TAIL:]}"
    except OSError as exc:
        return None, f"could not be run: {exc}"
    return proc.returncode, _text(proc.stdout or b"")[-OUTPUT_TAIL:]


# -- the service -----------------------------------------------------------------------------------


class NodeAgent:
    """One node's agent: its own consumer group on node.commands, one command at a time.

    A command's offset is committed once its result is on node.command.results (or once it is seen
    to be another node's): a command interrupted before that is delivered again at the next start,
    and the state folder says whether its reset had begun."""

    def __init__(
        self,
        bootstrap: str,
        settings: AgentSettings,
        probe: GpuProbe,
        runner: Runner,
        client_id: str = "trainmedic-node-agent",
    ) -> None:
        self.settings = settings
        self.probe = probe
        self.runner = runner
        self.host = socket.gethostname()
        self.stop_event = threading.Event()
        self.results: list[NodeCommandResult] = []
        self.log = CommandLog(settings.state_dir / f"commands-{settings.node}.jsonl")
        self._bootstrap = bootstrap
        self._publisher = Publisher(bootstrap, client_id)
        # A command may wait for the node to be idle and then for the reset: the group must not
        # give the partition away meanwhile.
        longest = settings.idle_timeout_s + settings.reset_timeout_s + settings.verify_timeout_s + 300
        self._client_id = client_id
        self._poll_ms = int(min(longest, 86_400) * 1000)
        self._watch: WatchedConsumer | None = None  # subscribed once the results are read back
        self._health = health.loop("node-agent", stale_after_s=max(180.0, settings.reset_timeout_s + 120))

    # -- start: what was done before --------------------------------------------------------------

    def _restore(self) -> bool:
        """Take back the results this node's agents published, and settle the commands a previous
        run began and never finished. False when node.command.results cannot be read: then nothing
        is done (a command might be run a second time)."""
        try:
            records = read_records(self._bootstrap, NODE_COMMAND_RESULTS.name, 0.0)
        except (KafkaException, TimeoutError) as exc:
            log.error("cannot read back %s (%s): not acting until it can be read", NODE_COMMAND_RESULTS.name, exc)
            return False
        mine = 0
        for _, value in records:
            try:
                result = decode(NodeCommandResult, value)
            except DecodeError as exc:
                log.error("unreadable record on %s skipped: %s", NODE_COMMAND_RESULTS.name, exc)
                continue
            if result.node == self.settings.node and result.cluster == current_cluster():
                self.log.published(result)
                mine += 1
        for command in self.log.interrupted():
            # Begun, never finished: the reset may or may not have happened. Not run again.
            now = time.time()
            self.log.finished(
                self._result(
                    command,
                    "failed",
                    "the agent stopped while the reset command ran: not run again; the GPU's state is "
                    "unknown, a person looks",
                    now,
                    now,
                )
            )
        log.info("%d result(s) of %s read back from %s", mine, self.settings.node, NODE_COMMAND_RESULTS.name)
        return True

    # -- one command -------------------------------------------------------------------------------

    def _result(
        self,
        command: NodeCommand,
        status: Literal["done", "failed", "refused"],
        detail: str,
        started: float,
        now: float,
    ) -> NodeCommandResult:
        return NodeCommandResult(
            event_id=stable_id("ncr", command.command_id),
            event_time=now,
            command_id=command.command_id,
            node=command.node,
            kind=command.kind,
            gpu=command.gpu,
            action_id=command.action_id,
            incident_id=command.incident_id,
            status=status,
            detail=detail[-8192:],
            agent=self.host[:200],
            started_at=started,
            finished_at=now,
        )

    def _look(self, command: NodeCommand) -> tuple[Verdict, GpuView]:
        try:
            slurm = read_slurm(self.runner, self.settings.node, self.settings.slurm_timeout_s)
        except (SlurmCommandError, SlurmFormatError, ValueError) as exc:
            return Verdict(wait=f"Slurm cannot be read ({exc})"), GpuView()
        # Slurm first: NVML is opened only for a node that is ours and free of jobs.
        verdict = judge_node(command, slurm)
        if not verdict.go:
            return verdict, GpuView()
        gpus = self.probe.look()
        return judge_gpus(command, gpus), gpus

    def carry_out(self, command: NodeCommand) -> NodeCommandResult | None:
        """Wait until the node is idle, reset, verify. None when asked to stop before the reset began
        (nothing done; the command is delivered again at the next start)."""
        s = self.settings
        started = time.time()
        deadline = time.monotonic() + s.idle_timeout_s
        said = ""
        while True:
            self._health.beat()
            if self.stop_event.is_set():
                return None
            # Every look reads Slurm and NVML afresh: the one that says go is the last before the reset.
            verdict, before = self._look(command)
            if verdict.refuse is not None:
                return self._result(command, "refused", verdict.refuse, started, time.time())
            if verdict.go:
                if self.stop_event.is_set():
                    return None  # asked to stop while looking: the reset is not begun
                return self._reset(command, before, started)
            why = verdict.wait or "?"
            if why != said:
                log.info("command %s (%s of %s): waiting: %s", command.command_id, command.kind, command.node, why)
                self._health.set_ready(True, f"waiting for {command.node} to be idle: {why}")
                said = why
            if time.monotonic() > deadline:
                return self._result(
                    command,
                    "refused",
                    f"not idle within the idle timeout of {s.idle_timeout_s:g} s; last seen: {why}",
                    started,
                    time.time(),
                )
            self.stop_event.wait(s.poll_interval_s)

    def _reset(self, command: NodeCommand, before: GpuView, started: float) -> NodeCommandResult:
        """The reset command, then NVML until the GPU answers again. Once begun, both run to their end
        (each bounded by its own timeout) whether or not stop is asked meanwhile: the result says
        what became of the GPU, not that the agent was leaving."""
        s = self.settings
        argv = s.argv(command.gpu)
        what = shlex.join(argv)
        self.log.started(command)
        log.warning("command %s: resetting %s on %s: %s", command.command_id, _which(command.gpu), s.node, what)
        self._health.set_ready(True, f"resetting {_which(command.gpu)}: {what}")
        code, tail = run_reset(argv, s.reset_timeout_s)
        self._health.beat()
        if code != 0:
            how = tail if code is None else f"exited {code}: {tail}"
            return self._finish(command, "failed", f"{what} {how}", started)
        if self.stop_event.is_set():
            log.warning(
                "command %s: asked to stop during the reset: verifying it first (at most %g s)",
                command.command_id,
                s.verify_timeout_s,
            )
        why_not = back_after_reset(before, self.probe.look(), command.gpu)
        verify_until = time.monotonic() + s.verify_timeout_s
        while why_not is not None and (left := verify_until - time.monotonic()) > 0:
            time.sleep(min(s.verify_interval_s, left))  # not stop_event.wait: a stop does not cut it short
            self._health.beat()
            why_not = back_after_reset(before, self.probe.look(), command.gpu)
        if why_not is not None:
            return self._finish(command, "failed", f"{what} exited 0, but {why_not}; output: {tail}", started)
        ids = ", ".join(
            f"GPU {i} {before.bus_ids[i]}" for i in ([command.gpu] if command.gpu is not None else before.bus_ids)
        )
        return self._finish(command, "done", f"{what} exited 0; back in NVML: {ids}; output: {tail}", started)

    def _finish(
        self, command: NodeCommand, status: Literal["done", "failed"], detail: str, started: float
    ) -> NodeCommandResult:
        result = self._result(command, status, detail, started, time.time())
        self.log.finished(result)
        return result

    def handle(self, command: NodeCommand) -> tuple[NodeCommandResult | None, bool]:
        """The command's result and whether it still has to be published; (None, False) when it was
        not finished (asked to stop)."""
        stage = self.log.stage(command.command_id)
        if stage == "published":
            done = self.log.result(command.command_id)
            log.info("command %s: already carried out (%s), not again", command.command_id, done and done.status)
            return done, False
        if stage == "finished":
            return self.log.result(command.command_id), True
        if stage == "started":
            now = time.time()
            interrupted = self._result(
                command, "failed", "the reset was begun earlier and never finished: not run again", now, now
            )
            self.log.finished(interrupted)
            return interrupted, True
        result = self.carry_out(command)
        if result is not None and result.status == "refused":
            self.log.finished(result)
        return result, result is not None

    # -- the loop ----------------------------------------------------------------------------------

    def _commit(self, msg: Message) -> None:
        assert self._watch is not None
        try:
            self._watch.consumer.commit(message=msg, asynchronous=False)
        except KafkaException as exc:
            log.warning(
                "commit after %s/%s failed (%s): the command is read again and recognised",
                msg.partition(),
                msg.offset(),
                exc,
            )

    def _process(self, msg: Message) -> bool:
        """Handle one record; False when it must be read again later."""
        try:
            command = decode(NodeCommand, msg.value() or b"")
        except DecodeError as exc:
            log.error("rejected undecodable command at %s/%s: %s", msg.partition(), msg.offset(), exc)
            letter = make_dead_letter(
                "sinks.node_agent",
                msg.topic() or NODE_COMMANDS.name,
                msg.partition(),
                msg.offset(),
                str(exc),
                msg.value(),
            )
            self._publisher.publish(DEADLETTER, letter)
            if self._publisher.flush(30) != 0:
                return False
            self._commit(msg)
            return True
        if command.node != self.settings.node or command.cluster != current_cluster():
            self._commit(msg)
            return True
        result, unpublished = self.handle(command)
        if result is None:
            return False
        if unpublished:
            try:
                self._publisher.publish_sync(NODE_COMMAND_RESULTS, result, timeout_s=30)
            except NotDelivered as exc:
                log.error(
                    "result of %s not delivered (%s): kept, published when the command is read again",
                    command.command_id,
                    exc,
                )
                return False
            self.log.published(result)
            self.results.append(result)
            metrics.NODE_COMMANDS.labels(result.kind, result.status).inc()
            log.info("command %s: %s: %s", command.command_id, result.status, result.detail)
        self._commit(msg)
        self._health.set_ready(True, f"consuming {NODE_COMMANDS.name}")
        return True

    def run(self) -> None:
        try:
            while not self._restore():
                self._health.set_ready(False, f"{NODE_COMMAND_RESULTS.name} cannot be read back")
                if self.stop_event.wait(5.0):
                    return
            # Watched (bus/watchdog.py): an agent that gets no partition, or does not move with
            # commands waiting, says so (not ready) and recovers, or its loop ends to be restarted.
            self._watch = watch = WatchedConsumer(
                self._bootstrap,
                self.settings.consumer_group,
                self._client_id,
                [NODE_COMMANDS.name],
                name="node-agent",
                background=True,
                overrides={"max.poll.interval.ms": self._poll_ms},
                on_assign=lambda _c, _ps: self._health.set_ready(True, f"consuming {NODE_COMMANDS.name}"),
            )
            self._health.set_ready(True, f"joining {self.settings.consumer_group}")
            while not self.stop_event.is_set():
                self._health.beat()
                # Raises ConsumerStalled when no remedy helped: the agent ends, its supervisor restarts it.
                stalled = watch.check()
                if stalled is not None:
                    self._health.set_ready(False, stalled)
                elif not self._health.ready:
                    self._health.set_ready(True, f"consuming {NODE_COMMANDS.name}")
                msg = watch.consumer.poll(0.5)
                if msg is None:
                    continue
                if (err := msg.error()) is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("consumer error: %s", err)
                    continue
                if not self._process(msg):
                    if self.stop_event.is_set():
                        break
                    # Not finished (a result not delivered): the same record again, after a pause.
                    watch.consumer.seek(
                        TopicPartition(msg.topic() or NODE_COMMANDS.name, msg.partition() or 0, msg.offset() or 0)
                    )
                    self.stop_event.wait(2.0)
        finally:
            self._health.stop()
            with contextlib.suppress(KafkaException, RuntimeError):
                if self._watch is not None:
                    self._watch.close()
            self._publisher.close(5)


def _which(gpu: int | None) -> str:
    return "every GPU" if gpu is None else f"GPU {gpu}"
