"""The GPU reset remediation (#20 item 4): the executor asks the node's agent once, and the agent
(sinks/node_agent.py) judges, resets and verifies - here piece by piece, NVML through the fake
pynvml module (tests/fakes/fake_pynvml.py), the reset command as a real process, the audit on real
chDB. The whole path on real Slurm and the real broker: tests/integration/test_gpu_reset_slurm.py."""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

import sinks.node_agent as node_agent
from bus.publish import NotDelivered
from schemas.events import Action, Evidence, Incident, NodeCommand, NodeCommandResult
from sinks.audit import TABLES, AuditStore
from sinks.backends.simulated import SimulatedScheduler
from sinks.executor import Executor, ExecutorSettings
from sinks.node_agent import (
    DEFAULT_RESET,
    AgentSettings,
    CommandLog,
    GpuProbe,
    GpuView,
    NodeAgent,
    NvmlUnavailable,
    ResetCommandError,
    SlurmView,
    back_after_reset,
    jobs_on,
    judge,
    parse_argv,
    run_reset,
)
from slurmio import JobInfo, NodeInfo
from streams.policy import decide, parse_policy
from tests.fakes.fake_pynvml import FakeNvml, h100_gpus

INC = "inc-0123456789abcdef0123"
REASON = f"trainmedic {INC}: gpu_hardware"
COMPUTE, GRAPHICS, MPS = (
    pynvml.NVML_PROCESS_MODE_COMPUTE,
    pynvml.NVML_PROCESS_MODE_GRAPHICS,
    pynvml.NVML_PROCESS_MODE_MPS,
)


def command(gpu: int | None = 2, node: str = "gpu03") -> NodeCommand:
    return NodeCommand(
        event_id="cmd-1",
        event_time=1.0,
        command_id="cmd-1",
        node=node,
        kind="gpu_reset",
        gpu=gpu,
        action_id="act-1",
        incident_id=INC,
        reason=REASON,
        requested_by="policy",
        issued_at=1.0,
    )


def drained(reason: str | None = REASON, state: str = "IDLE", flags: tuple[str, ...] = ("DRAIN",)) -> SlurmView:
    return SlurmView(NodeInfo("gpu03", state, flags, reason))


IDLE_GPUS = GpuView({i: f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(8)})


# --- the reset command --------------------------------------------------------------------------


def test_the_reset_command_names_the_gpu_and_the_reset_of_every_gpu_names_none() -> None:
    s = AgentSettings(node="gpu03", state_dir=Path("/nonexistent"))
    assert s.argv(2) == ["nvidia-smi", "--gpu-reset", "-i", "2"]
    assert s.argv(None) == ["nvidia-smi", "--gpu-reset"]
    assert parse_argv("/opt/reset.sh --gpu={gpu} 'a b'", "x", needs_gpu=True) == ("/opt/reset.sh", "--gpu={gpu}", "a b")
    assert parse_argv("nvidia-smi --gpu-reset -i {gpu}", "x", needs_gpu=True) == DEFAULT_RESET
    for text, needs_gpu, problem in [
        ("nvidia-smi --gpu-reset", True, "must name the GPU"),
        ("nvidia-smi --gpu-reset -i {gpu}", False, "no {gpu}"),
        ("", True, "empty"),
        ("reset 'unclosed", True, "quotation"),
    ]:
        with pytest.raises(ResetCommandError, match=problem):
            parse_argv(text, "--reset-command", needs_gpu)


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_reset_command_runs_as_a_process_with_its_output_tail_and_a_time_limit(tmp_path: Path) -> None:
    ok = _script(tmp_path / "ok.sh", 'echo "GPU 00000000:38:00.0 was successfully reset."; echo "args: $*"\n')
    assert run_reset([str(ok), "2"], 10) == (0, "GPU 00000000:38:00.0 was successfully reset.\nargs: 2\n")
    busy = _script(tmp_path / "busy.sh", "echo 'GPU 00000000:38:00.0: In use by another client' >&2; exit 255\n")
    assert run_reset([str(busy)], 10) == (255, "GPU 00000000:38:00.0: In use by another client\n")
    long = _script(tmp_path / "long.sh", "yes | head -c 5000; sleep 30\n")
    t0 = time.monotonic()
    code, tail = run_reset([str(long)], 0.5)
    assert code is None and tail.startswith("timed out after 0.5 s and was killed") and time.monotonic() - t0 < 10
    assert len(tail) < 2200  # the tail, not all of it
    code, tail = run_reset([str(tmp_path / "missing")], 10)
    assert code is None and "could not be run" in tail


# --- Slurm's part of the judgement ----------------------------------------------------------------


def job(job_id: str, state: str, nodes: str, base: str | None = None, flags: tuple[str, ...] = ()) -> JobInfo:
    return JobInfo(
        job_id=job_id, state=state, base_state=state if base is None else base, state_flags=flags, nodes=nodes
    )


def test_jobs_on_the_node_are_those_holding_it_whatever_the_slurm_version_says() -> None:
    jobs = [
        job("1", "RUNNING", "gpu[01-04]"),
        job("2", "COMPLETED", "gpu03"),  # 22.05 lists finished jobs with their nodes
        job("3", "COMPLETING", "gpu03", base=""),  # 22.05: the shown flag, no base state
        job("4", "PENDING", "gpu03", flags=("COMPLETING", "REQUEUED")),  # 24.11: requeued, still leaving
        job("5", "PENDING", ""),
        job("6", "RUNNING", "gpu[01-02]"),
        job("7", "SUSPENDED", "gpu03"),
        job("8", "REQUEUED", "gpu03", base=""),  # a state this code does not place: holds the node
        job("9", "CANCELLED", "gpu03"),
    ]
    assert jobs_on("gpu03", jobs) == ("1", "3", "4", "7", "8")
    assert jobs_on("gpu05", jobs) == ()


@pytest.mark.parametrize(
    ("view", "verdict"),
    [
        (SlurmView(None), "refuse: Slurm does not know node gpu03"),
        (drained(state="IDLE", flags=()), "refuse: gpu03 is not drained any more (IDLE): it was returned to service"),
        (drained(reason="NHC: ECC errors"), "refuse: gpu03 is drained for another reason now"),
        (drained(reason="trainmedic inc-other: gpu_hardware"), "refuse: gpu03 is drained for inc-other now"),
        (SlurmView(NodeInfo("gpu03", "MIXED", ("DRAIN",), REASON), ("42",)), "wait: job(s) 42 still on gpu03"),
        (drained(state="MIXED"), "wait: gpu03 is MIXED+DRAIN per Slurm, not IDLE+DRAIN"),
        (drained(flags=("COMPLETING", "DRAIN")), "wait: gpu03 is IDLE+COMPLETING+DRAIN per Slurm"),
        (drained(state="DOWN", flags=("DRAIN", "NOT_RESPONDING")), "wait: gpu03 is DOWN+DRAIN+NOT_RESPONDING"),
        (drained(reason=f"{REASON} | gpu reset (RESET_GPU)"), "go"),
    ],
)
def test_slurm_must_say_the_node_is_still_ours_and_idle(view: SlurmView, verdict: str) -> None:
    v = judge(command(), view, IDLE_GPUS)
    said = "go" if v.go else f"refuse: {v.refuse}" if v.refuse else f"wait: {v.wait}"
    assert said.startswith(verdict), said


# --- NVML's part ----------------------------------------------------------------------------------


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(h100_gpus(8))


def test_an_idle_node_is_one_whose_gpus_nvml_reads_without_processes(fake: FakeNvml) -> None:
    probe = GpuProbe(fake)
    assert probe.check() == 8
    view = probe.look()
    assert view.users == () and view.problems == ()
    assert view.bus_ids[2] == "00000000:38:00.0" and len(view.bus_ids) == 8
    assert judge(command(), drained(), view).go
    assert fake.initialized == 0  # NVML is closed after each look: an open client would block the reset


@pytest.mark.parametrize(
    ("setup", "verdict"),
    [
        (lambda f: f.gpus[2].processes.update({COMPUTE: [(4242, 1 << 30)]}), "wait: GPU 2: compute process 4242"),
        # Another GPU than the one to reset: someone uses the node outside Slurm.
        (lambda f: f.gpus[6].processes.update({GRAPHICS: [(99, 0)]}), "wait: GPU 6: graphics process 99"),
        (lambda f: f.gpus[0].processes.update({MPS: [(7, 0)]}), "wait: GPU 0: MPS process 7"),
        (lambda f: f.lose(2), "wait: GPU 2 does not answer NVML (GPU is lost)"),
        (
            lambda f: f.gpus[4].errors.update(
                {"nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION}
            ),
            "wait: GPU 4: compute processes not readable (Insufficient Permissions)",
        ),
        # A GPU without MPS has no MPS clients: not a doubt.
        (lambda f: f.gpus[4].unsupported.add("nvmlDeviceGetMPSComputeRunningProcesses"), "go"),
        (lambda f: f.gpus[4].unsupported.add("nvmlDeviceGetComputeRunningProcesses"), "wait: GPU 4: compute processes"),
        (lambda f: setattr(f, "init_error", pynvml.NVML_ERROR_DRIVER_NOT_LOADED), "wait: NVML does not answer"),
        (lambda f: f.gpus.__delitem__(slice(2, None)), "refuse: GPU 2 is not on gpu03 per NVML (GPUs [0, 1])"),
        (lambda f: f.gpus.clear(), "refuse: NVML sees no GPU on gpu03"),
    ],
)
def test_anything_on_a_gpu_or_unreadable_about_it_is_a_reason_to_wait(fake: FakeNvml, setup: Any, verdict: str) -> None:
    setup(fake)
    v = judge(command(), drained(), GpuProbe(fake).look())
    said = "go" if v.go else f"refuse: {v.refuse}" if v.refuse else f"wait: {v.wait}"
    assert said.startswith(verdict), said


def test_without_nvml_the_agent_does_not_start(fake: FakeNvml) -> None:
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(NvmlUnavailable, match="NVML is not available on this host"):
        GpuProbe(fake).check()


def test_after_the_reset_the_gpu_answers_again_at_its_index_with_its_bus_id(fake: FakeNvml) -> None:
    probe = GpuProbe(fake)
    before = probe.look()
    assert back_after_reset(before, probe.look(), 2) is None
    assert back_after_reset(before, probe.look(), None) is None
    fake.lose(2)
    assert back_after_reset(before, probe.look(), 2) == (
        "GPU 2 (00000000:38:00.0) does not answer NVML after the reset: GPU 2 does not answer NVML (GPU is lost)"
    )
    assert back_after_reset(before, probe.look(), 5) is None  # another GPU than the one reset
    assert "GPU 2 (00000000:38:00.0) does not answer" in (back_after_reset(before, probe.look(), None) or "")
    fake.gpus[2].lost_code = None
    fake.gpus[3].pci_bus_id = "00000000:99:00.0"
    assert back_after_reset(before, probe.look(), 3) == (
        "GPU 3 is 00000000:99:00.0 after the reset, was 00000000:48:00.0: not the same GPU"
    )
    assert back_after_reset(GpuView(), probe.look(), None) == "no GPU was seen before the reset"


# --- never twice: the state folder ----------------------------------------------------------------


def result(status: str = "done") -> NodeCommandResult:
    return NodeCommandResult(
        event_id="ncr-1",
        event_time=3.0,
        command_id="cmd-1",
        node="gpu03",
        kind="gpu_reset",
        gpu=2,
        action_id="act-1",
        incident_id=INC,
        status=status,  # type: ignore[arg-type]
        detail="ok",
        agent="gpu03",
        started_at=2.0,
        finished_at=3.0,
    )


def test_the_command_log_survives_a_restart_and_says_what_was_begun_and_never_finished(tmp_path: Path) -> None:
    path = tmp_path / "state" / "commands-gpu03.jsonl"
    log = CommandLog(path)
    assert log.stage("cmd-1") is None and log.interrupted() == []
    cmd = command()
    log.started(cmd)
    again = CommandLog(path)
    assert again.stage("cmd-1") == "started" and again.interrupted() == [cmd]
    done = result()
    again.finished(done)
    with path.open("ab") as f:
        f.write(b'{"command_id": "cmd-1", "stage": "publ')  # torn by a power loss
    third = CommandLog(path)
    assert third.stage("cmd-1") == "finished" and third.result("cmd-1") == done and third.interrupted() == []
    third.published(done)
    assert CommandLog(path).stage("cmd-1") == "published"
    # A result read back from node.command.results, of a command this folder never saw (a new disk).
    fresh = CommandLog(tmp_path / "other.jsonl")
    refused = result("refused")
    fresh.published(refused)
    assert CommandLog(tmp_path / "other.jsonl").result("cmd-1") == refused


# --- carrying a command out: wait, reset, verify (NodeAgent.carry_out, Kafka left out) ---------------


BUSY = SlurmView(NodeInfo("gpu03", "MIXED", ("DRAIN",), REASON), ("42",))


class Scene:
    """One agent for node gpu03 with the fake pynvml module, Slurm answering `views` look by look (the
    last one again once they run out), the reset a real script; `events` says in which order Slurm
    was read and the reset run."""

    def __init__(self, tmp_path: Path, fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> None:
        self.fake = fake
        self.views: list[SlurmView] = [drained()]
        self.events: list[str] = []
        self.on_read: Callable[[], None] = lambda: None
        self.resets = tmp_path / "resets.txt"
        script = _script(
            tmp_path / "reset.sh",
            f'echo "begun $*" >> {self.resets}\nsleep "${{RESET_SLEEP:-0}}"\necho "done $*" >> {self.resets}\n'
            'echo "GPU 00000000:38:00.0 was successfully reset."\n',
        )
        monkeypatch.setattr(node_agent, "Publisher", lambda *a, **k: None)
        monkeypatch.setattr(node_agent, "read_slurm", self._read_slurm)
        self.real_run_reset = node_agent.run_reset
        self.during_reset: Callable[[], None] = lambda: None
        monkeypatch.setattr(node_agent, "run_reset", self._run_reset)
        defaults: dict[str, Any] = {"poll_interval_s": 0.05, "verify_interval_s": 0.05, "verify_timeout_s": 10.0}
        config = AgentSettings(
            node="gpu03",
            state_dir=tmp_path / "state",
            reset_command=(str(script), "-i", "{gpu}"),
            reset_all_command=(str(script), "all"),
            **{**defaults, **settings},
        )
        self.agent = NodeAgent("127.0.0.1:1", config, GpuProbe(fake), runner=lambda argv, timeout: "")

    def _read_slurm(self, runner: Any, node: str, timeout: float) -> SlurmView:
        view = self.views.pop(0) if len(self.views) > 1 else self.views[0]
        self.on_read()
        v = node_agent.judge_node(command(), view)
        self.events.append("slurm: " + ("go" if v.go else "refuse" if v.refuse else "wait"))
        return view

    def _run_reset(self, argv: Any, timeout_s: float) -> tuple[int | None, str]:
        self.events.append("reset")
        self.during_reset()
        return self.real_run_reset(argv, timeout_s)

    def reset_lines(self) -> list[str]:
        return self.resets.read_text().splitlines() if self.resets.exists() else []


@pytest.fixture
def scene(tmp_path: Path, fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Scene]]:
    made: list[Scene] = []

    def make(**settings: Any) -> Scene:
        made.append(Scene(tmp_path, fake, monkeypatch, **settings))
        return made[-1]

    yield make
    for s in made:
        s.agent._health.stop()


def test_a_stop_asked_during_the_reset_lets_it_and_its_verification_finish_and_reports_the_outcome(
    scene: Callable[..., Scene], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = scene()
    monkeypatch.setenv("RESET_SLEEP", "0.3")

    def sigterm_while_nvidia_smi_runs() -> None:
        s.agent.stop_event.set()
        # The reset takes the GPU away from NVML; it answers again 0.8 s after the command returned.
        s.fake.lose(2)
        threading.Timer(1.1, lambda: setattr(s.fake.gpus[2], "lost_code", None)).start()

    s.during_reset = sigterm_while_nvidia_smi_runs
    t0 = time.monotonic()
    result = s.agent.carry_out(command())
    assert result is not None and result.status == "done", result
    assert time.monotonic() - t0 >= 1.0  # it waited for the GPU, stop or no stop
    assert "back in NVML: GPU 2 00000000:38:00.0" in result.detail and "successfully reset" in result.detail
    assert s.reset_lines() == ["begun -i 2", "done -i 2"]  # the command was not cut short
    assert s.agent.log.stage("cmd-1") == "finished" and s.agent.log.result("cmd-1") == result


def test_a_stop_does_not_stretch_the_verification_past_its_own_timeout(
    scene: Callable[..., Scene], fake: FakeNvml
) -> None:
    s = scene(verify_timeout_s=0.6)

    def gone_for_good() -> None:
        s.agent.stop_event.set()
        fake.lose(2)

    s.during_reset = gone_for_good
    t0 = time.monotonic()
    result = s.agent.carry_out(command())
    took = time.monotonic() - t0
    assert result is not None and result.status == "failed", result
    assert 0.6 <= took < 5
    assert "exited 0, but GPU 2 (00000000:38:00.0) does not answer NVML after the reset" in result.detail
    assert s.agent.log.stage("cmd-1") == "finished"


def test_a_stop_asked_before_the_reset_began_stops_at_once_and_resets_nothing(
    scene: Callable[..., Scene], fake: FakeNvml
) -> None:
    # While waiting for the node to be idle: a job on it.
    s = scene(poll_interval_s=30.0)
    s.views = [BUSY]
    threading.Timer(0.3, s.agent.stop_event.set).start()
    t0 = time.monotonic()
    assert s.agent.carry_out(command()) is None
    assert time.monotonic() - t0 < 5  # not the 30 s poll interval
    assert s.reset_lines() == [] and s.agent.log.stage("cmd-1") is None and "reset" not in s.events
    # While the look that would say go is under way (the signal lands during squeue).
    s.agent.stop_event.clear()
    s.views = [drained()]
    s.on_read = s.agent.stop_event.set
    assert s.agent.carry_out(command()) is None
    assert s.reset_lines() == [] and s.agent.log.stage("cmd-1") is None and "reset" not in s.events
    # Already asked to stop: Slurm is not even read.
    s.events.clear()
    assert s.agent.carry_out(command()) is None and s.events == []


@pytest.mark.parametrize(
    ("changed", "refusal"),
    [
        # `scontrol update nodename=gpu03 state=resume`
        (drained(flags=()), "gpu03 is not drained any more (IDLE): it was returned to service"),
        # `scontrol update nodename=gpu03 reason="hold: no reset"`
        (drained(reason="hold: no reset"), "gpu03 is drained for another reason now (reason 'hold: no reset')"),
    ],
)
def test_the_drain_is_read_again_right_before_the_reset_so_a_resume_or_new_reason_stops_a_waiting_command(
    scene: Callable[..., Scene], changed: SlurmView, refusal: str
) -> None:
    s = scene()
    # The job leaves, and in the same moment the operator acts: the look that finds the node idle
    # also finds it is no longer drained for the incident.
    s.views = [BUSY, BUSY, changed]
    result = s.agent.handle(command())
    assert result[0] is not None and result[0].status == "refused" and result[0].detail.startswith(refusal)
    assert s.events == ["slurm: wait", "slurm: wait", "slurm: refuse"] and s.reset_lines() == []
    assert s.agent.log.stage("cmd-1") == "finished"


def test_the_look_that_says_go_is_the_last_thing_before_the_reset(scene: Callable[..., Scene]) -> None:
    s = scene()
    s.views = [BUSY, drained()]
    result = s.agent.carry_out(command())
    assert result is not None and result.status == "done", result
    assert s.events == ["slurm: wait", "slurm: go", "reset"]
    assert s.reset_lines() == ["begun -i 2", "done -i 2"]


# --- the executor asks, once ----------------------------------------------------------------------


def reset_action(gpu: int | None = 2) -> Action:
    now = time.time()
    return Action(
        event_id="act-r1",
        event_time=now,
        action_id="act-r1",
        decision_id="dec-r1",
        incident_id=INC,
        node="gpu02",
        partition="gpu",
        action="drain_and_requeue",
        remediation="reset_gpu",
        remediation_bucket="RESET_GPU",
        culprit_gpu=gpu,
        reason=REASON,
        requested_by="policy",
        incident_time=now,
        first_signal_time=now,
        node_reported_fault=True,
    )


def executor(sched: SimulatedScheduler, sent: list[NodeCommand] | None) -> Executor:
    ex = Executor(sched, ExecutorSettings(verify_timeout_s=5, poll_interval_s=0.01))
    if sent is not None:
        ex.publish_command = sent.append
    return ex


def test_the_executor_asks_the_node_agent_once_and_marks_the_drain_reason() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    sent: list[NodeCommand] = []
    calls: list[str] = []
    ex = executor(sched, sent)
    first = ex.execute(reset_action(), lambda a, call: calls.append(call))
    assert first.status == "done", first
    (cmd,) = sent
    assert (cmd.node, cmd.kind, cmd.gpu, cmd.incident_id, cmd.action_id) == ("gpu02", "gpu_reset", 2, INC, "act-r1")
    assert cmd.command_id.startswith("cmd-") and cmd.reason == REASON
    assert any(
        f"gpu reset of GPU 2 on gpu02: asked of its node agent (RESET_GPU, command {cmd.command_id})" in s
        for s in first.steps
    )
    state = sched.node_state("gpu02")
    assert state.drained and state.reason == f"{REASON} | gpu reset (RESET_GPU)"
    assert calls == ["drain", "reset_gpu"]
    again = ex.execute(reset_action(), lambda a, call: calls.append(call))
    assert again.status == "done" and any("gpu reset on gpu02: already asked" in s for s in again.steps)
    assert len(sent) == 1 and calls.count("reset_gpu") == 1
    assert (sched.node_state("gpu02").reason or "").count("gpu reset") == 1


def test_a_command_that_is_not_acknowledged_leaves_the_node_drained_unmarked_and_is_asked_again() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    ex = executor(sched, None)

    def broker_away(command: NodeCommand) -> None:
        raise NotDelivered("node.commands event cmd-x not acknowledged: no answer in 30 s")

    ex.publish_command = broker_away
    result = ex.execute(reset_action(None), lambda a, call: None)
    assert result.status == "done" and sched.node_state("gpu02").drained
    assert any("gpu reset on gpu02 not asked (node.commands event cmd-x not acknowledged" in s for s in result.steps)
    assert sched.node_state("gpu02").reason == REASON  # no marker: a redelivery asks again
    sent: list[NodeCommand] = []
    ex.publish_command = sent.append
    again = ex.execute(reset_action(None), lambda a, call: None)
    assert [c.gpu for c in sent] == [None] and any("gpu reset of every GPU on gpu02" in s for s in again.steps)


def test_no_agent_reachable_or_a_drain_that_is_not_ours_asks_nothing() -> None:
    sched = SimulatedScheduler(["gpu01", "gpu02"])
    result = executor(sched, None).execute(reset_action(), lambda a, call: None)
    assert any("not asked: no node agent can be reached" in s for s in result.steps)
    other = SimulatedScheduler(["gpu01", "gpu02"])
    other.drain_node("gpu02", "NHC: ECC errors")
    sent: list[NodeCommand] = []
    calls: list[str] = []
    result = executor(other, sent).execute(reset_action(), lambda a, call: calls.append(call))
    assert sent == [] and calls == [] and other.node_state("gpu02").reason == "NHC: ECC errors"
    assert any("not asked: it is not drained for" in s for s in result.steps)


def test_policy_carries_the_culprit_gpu_of_a_reset_gpu_xid_to_the_action() -> None:
    policy = parse_policy(
        "mode: autonomous\nremediation: {enabled: true}\nactions: {gpu_hardware: drain_and_requeue, node: "
        "drain_and_requeue, interconnect: requeue, hang: requeue, user_code: stop, oom: stop, numerical: stop, "
        "storage: stop, healthy: none}\n"
    )
    incident = Incident(
        event_id=INC,
        incident_id=INC,
        event_time=10.0,
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        culprit_gpu=2,
        confidence=0.95,
        isolate=True,
        explanation="x",
        anomaly_ids=["a"],
        first_signal_time=9.0,
        evidence=[Evidence(source="kernel", signature="xid_95", node="gpu02", time=9.0, line="l", role="root", gpu=2)],
    )
    _, action = decide(policy, incident, 11.0)
    assert action is not None
    assert (action.remediation, action.remediation_bucket, action.culprit_gpu) == ("reset_gpu", "RESET_GPU", 2)


# --- the audit ------------------------------------------------------------------------------------


def test_the_audit_says_where_a_nodes_reset_stands(chdb_url: str, database: str) -> None:
    store = AuditStore(chdb_url, database)
    try:
        store.migrate()
        issued = command().model_copy(update={"event_time": time.time() - 60, "issued_at": time.time() - 60})

        def insert(event: NodeCommand | NodeCommandResult, topic: str) -> None:
            _, table, to_row, cols = TABLES[topic]
            store.insert(table, [to_row(event)], cols)

        # What the automatic return to service asks (trainmedic/ops/return_to_service.py).
        latest = (
            "SELECT status, finished_at FROM {db}.node_commands FINAL WHERE node = {n:String} "
            "AND kind = 'gpu_reset' ORDER BY finished_at DESC LIMIT 1"
        )
        insert(issued, "node.commands")
        assert [(r["status"], r["finished_at"]) for r in store.query(latest, {"n": "gpu03"})] == [("issued", None)]
        done = result().model_copy(update={"event_time": time.time(), "finished_at": time.time()})
        insert(done, "node.command.results")
        insert(done, "node.command.results")  # redelivered
        insert(issued, "node.commands")
        (row,) = store.query(latest, {"n": "gpu03"})
        assert row["status"] == "done" and row["finished_at"].timestamp() == pytest.approx(done.finished_at, abs=0.01)
        assert store.query(latest, {"n": "gpu04"}) == []
        # "Was the reset of node X for incident Y done, and when": one row per command and outcome.
        rows = store.query(
            "SELECT status, gpu, action_id, agent, detail, reason, issued_at FROM {db}.node_commands FINAL "
            "WHERE node = 'gpu03' AND incident_id = {i:String} ORDER BY event_time",
            {"i": INC},
        )
        assert [(r["status"], r["gpu"], r["action_id"], r["agent"]) for r in rows] == [
            ("issued", 2, "act-1", ""),
            ("done", 2, "act-1", "gpu03"),
        ]
        assert rows[0]["reason"] == REASON and rows[0]["issued_at"] is not None and rows[1]["detail"] == "ok"
    finally:
        store.close()
