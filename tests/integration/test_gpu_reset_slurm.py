"""The GPU reset remediation on the REAL Slurm 22.05 and 24.11 clusters and the real broker (#20 item 4).

An Xid 95 (NVIDIA's RESET_GPU bucket) in gpu03's kernel log, GPU 2 by its PCI address, under an
autonomous policy with remediation enabled: the running stack drains gpu03, marks the drain reason
`| gpu reset (RESET_GPU)` and publishes one command on node.commands - also when the action is
delivered to the executor again. The node agent, a real `trainmedic run node-agent` process on
`gpu03` whose NVML is the fake pynvml module (tests/fakes/nvml_site) and whose reset command is a
script recording its arguments, waits while a job still runs on gpu03, then resets GPU 2 once:
the command delivered again, and an agent restarted on a fresh state folder (it reads its results
back from node.command.results), change nothing. The audit's `node_commands` says `done`.

Agent-only cases (the command published here, gpu03 drained here under a trainmedic reason): a GPU
with a running process is not reset and the command is refused after the idle timeout; a command
for another incident than the drain's is refused at once; an agent killed while its reset runs
reports the command failed after its restart and never runs it again.

Only gpu03 is drained, and only this test's jobs are cancelled: other tests use the clusters too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.publish import Publisher
from producers.gpu_nvml import NvmlCollector
from producers.kernel import KernelLogProducer, nvml_gpu_index
from schemas.codec import decode
from schemas.events import ActionResult, NodeCommand, NodeCommandResult
from schemas.topics import ACTION_RESULTS, ACTIONS, NODE_COMMAND_RESULTS, NODE_COMMANDS
from sinks.backends.slurm_cli import SlurmCliBackend
from tests.conftest import REPO, Cluster, read_topic, wait_for
from tests.fakes.fake_pynvml import FakeNvml, h100_gpus
from tests.integration.scenario import policy_file, start_stack
from tests.integration.test_slurm_coexistence import _sh
from tests.launch import Launched, start, stop, wait_ready
from trainmedic.stack.broker import EmbeddedBroker, free_port

pytestmark = pytest.mark.slurm
NODE = "gpu03"
SHIM = REPO / "tests" / "fakes" / "nvml_site"
TRAINMEDIC = str(Path(sys.executable).with_name("trainmedic"))
# GPU 2 of the fake node (h100_gpus: bus 0x18 + 0x10 * index).
XID95 = (
    "Dec  3 10:00:00 {node} kernel: [ 1234.567890] NVRM: Xid (PCI:0000:38:00): 95, pid=2342, name=python, "
    "Uncontained: FBHUB. RST: Yes, D-RST: No"
)


def _node_free(cluster: Cluster) -> None:
    """gpu03 undrained and idle (a drain of an earlier run resumed); other nodes left alone."""
    backend = SlurmCliBackend(cluster.runner())
    if backend.node_state(NODE).drained:
        _sh(cluster, "scontrol", "update", f"nodename={NODE}", "state=resume")
    wait_for(
        f"{NODE} idle and undrained",
        lambda: (s := backend.node_state(NODE)).state == "IDLE" and not s.flags,
        timeout=120,
        interval=0.5,
    )


@pytest.fixture
def cluster(slurm_any: Cluster) -> Iterator[Cluster]:
    _node_free(slurm_any)
    yield slurm_any
    _node_free(slurm_any)


class Agent:
    """`trainmedic run node-agent --node gpu03` as a process, NVML faked, the reset a script."""

    def __init__(self, cluster: Cluster, bootstrap: str, folder: Path, processes: dict[str, Any] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.cluster, self.bootstrap = folder, cluster, bootstrap
        self.resets = folder / "resets.txt"
        self.nvml = folder / "nvml.json"
        self.nvml.write_text(json.dumps({"gpus": 8, "processes": processes or {}}))
        self.launched: Launched | None = None
        self.starts = 0

    def script(self, body: str = "") -> Path:
        path = self.folder / f"reset-{self.starts}.sh"
        path.write_text(
            f'#!/bin/sh\necho "$*" >> {self.resets}\n{body}\necho "GPU 00000000:38:00.0 was successfully reset."\n'
        )
        path.chmod(0o755)
        return path

    def start(self, state: str = "state", idle_timeout: float = 300, script_body: str = "") -> Agent:
        self.starts += 1
        script = self.script(script_body)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
        env.update(self.cluster.env())
        env.update(
            PYTHONPATH=f"{SHIM}:{REPO}",
            TRAINMEDIC_FAKE_NVML=str(self.nvml),
            TRAINMEDIC_BOOTSTRAP=self.bootstrap,
        )
        argv = [TRAINMEDIC, "run", "node-agent", "--node", NODE]
        argv += ["--reset-command", f"{script} -i {{gpu}}", "--reset-all-command", f"{script} all"]
        argv += ["--idle-timeout", str(idle_timeout), "--poll-interval", "0.3"]
        argv += ["--state-dir", str(self.folder / state), "--metrics-address", f"127.0.0.1:{port}"]
        self.launched = start(argv, env, self.folder / f"agent-{self.starts}.log")
        wait_ready(self.launched, f"http://127.0.0.1:{port}/readyz", timeout=60)
        return self

    def output(self) -> str:
        return self.launched.output(20_000) if self.launched else ""

    def stop(self) -> int | None:
        if self.launched is None:
            return None
        code = stop(self.launched)
        self.launched = None
        return code

    def reset_calls(self) -> list[str]:
        return self.resets.read_text().splitlines() if self.resets.exists() else []


def _records(bootstrap: str, topic: str, event_type: type[Any], seconds: float = 2.0) -> list[Any]:
    return [decode(event_type, v) for v in read_topic(bootstrap, topic, seconds)]


def _results(bootstrap: str, seconds: float = 2.0) -> list[NodeCommandResult]:
    return _records(bootstrap, NODE_COMMAND_RESULTS.name, NodeCommandResult, seconds)


def test_a_reset_gpu_xid_drains_asks_once_and_the_agent_resets_once_nothing_runs(
    broker: EmbeddedBroker, cluster: Cluster, chdb_url: str, database: str, tmp_path: Path
) -> None:
    backend = SlurmCliBackend(cluster.runner())
    # A job on gpu03 the fault is not blamed on (no placement is published): Slurm drains the node
    # around it, and the agent must wait for it to end.
    job = _sh(
        cluster, "sbatch", "--parsable", f"--nodelist={NODE}", "--nodes=1", "--output=/dev/null", "--wrap", "sleep 600"
    )
    job = job.strip().split(";")[0]
    agent = Agent(cluster, broker.bootstrap, tmp_path / "agent")
    stack = None
    try:
        wait_for(f"job {job} RUNNING on {NODE}", lambda: backend.job_state(job).nodes == (NODE,), timeout=60)
        agent.start()
        policy = policy_file(tmp_path, mode="autonomous", remediation={"enabled": True})
        stack = start_stack(broker.bootstrap, chdb_url, database, backend, tmp_path / "stack", policy=policy)
        store = stack.store
        assert store is not None
        kern = tmp_path / "kern.log"
        kern.write_text(XID95.format(node=NODE) + "\n")
        pub = Publisher(broker.bootstrap, "test-kernel")
        index_of = nvml_gpu_index(NvmlCollector(FakeNvml(h100_gpus(8))))
        KernelLogProducer(pub, kern, node=NODE, from_start=True, gpu_index_of=index_of).poll_once()
        assert pub.flush(10) == 0

        result = wait_for(
            "the executor's result for gpu03",
            lambda: store.query("SELECT * FROM {db}.action_results FINAL WHERE node = {n:String}", {"n": NODE}),
            timeout=120,
        )[0]
        steps = " | ".join(result["steps"])
        assert result["status"] == "done", result
        assert "gpu reset of GPU 2 on gpu03: asked of its node agent (RESET_GPU, command cmd-" in steps, steps
        incident = str(result["incident_id"])
        state = backend.node_state(NODE)
        assert state.drained and state.reason == f"trainmedic {incident}: gpu_hardware | gpu reset (RESET_GPU)"
        (command,) = _records(broker.bootstrap, NODE_COMMANDS.name, NodeCommand)
        assert (command.node, command.gpu, command.incident_id) == (NODE, 2, incident)

        # The action delivered to the executor again: it sees its marker and asks nothing.
        (raw_action,) = read_topic(broker.bootstrap, ACTIONS.name)
        pub.publish_raw(ACTIONS.name, raw_action, key=NODE.encode())
        assert pub.flush(10) == 0
        again = wait_for(
            "the redelivered action's result",
            lambda: (r := _records(broker.bootstrap, ACTION_RESULTS.name, ActionResult, 1.0))[1:] and r,
            timeout=60,
        )
        assert any("gpu reset on gpu03: already asked of its node agent" in s for s in again[1].steps), again[1]
        assert len(read_topic(broker.bootstrap, NODE_COMMANDS.name)) == 1

        # The job still runs on gpu03: the agent waits, resets nothing.
        wait_for("the agent waiting for the job", lambda: f"job(s) {job} still on {NODE}" in agent.output(), 30)
        time.sleep(2)  # absence: the agent's polls (0.3 s) in this window reset nothing
        assert agent.reset_calls() == [] and _results(broker.bootstrap) == []
        # The command delivered again while the agent waits: queued behind it, never run twice.
        pub.publish_sync(NODE_COMMANDS, command)
        _sh(cluster, "scancel", job)
        latest = (
            "SELECT status, finished_at FROM {db}.node_commands FINAL WHERE node = {n:String} "
            "AND kind = 'gpu_reset' ORDER BY finished_at DESC LIMIT 1"
        )
        row = wait_for(
            "the reset done in the audit",
            lambda: [r for r in store.query(latest, {"n": NODE}) if r["status"] == "done"],
            timeout=60,
        )[0]
        assert row["finished_at"] is not None
        assert agent.reset_calls() == ["-i 2"]
        (done,) = _results(broker.bootstrap)
        assert done.status == "done" and done.incident_id == incident and "GPU 2 00000000:38:00.0" in done.detail
        wait_for("the redelivered command recognised", lambda: "already carried out" in agent.output(), 30)

        # A restarted agent with an empty state folder reads its results back: still one reset.
        assert agent.stop() == 0
        agent.start(state="state-2")
        pub.publish_sync(NODE_COMMANDS, command)
        wait_for("the command recognised after the restart", lambda: "already carried out" in agent.output(), 60)
        assert agent.reset_calls() == ["-i 2"] and len(_results(broker.bootstrap)) == 1
        assert backend.node_state(NODE).drained  # back to service only through its health check
        pub.close()
    finally:
        _sh(cluster, "scancel", job)
        agent.stop()
        if stack is not None:
            stack.stop()


def _command(incident: str, gpu: int | None = 2, action: str = "act-test") -> NodeCommand:
    now = time.time()
    return NodeCommand(
        event_id=f"cmd-{action}",
        event_time=now,
        command_id=f"cmd-{action}",
        node=NODE,
        kind="gpu_reset",
        gpu=gpu,
        action_id=action,
        incident_id=incident,
        reason=f"trainmedic {incident}: gpu_hardware",
        requested_by="policy",
        issued_at=now,
    )


def _drain_as_trainmedic(cluster: Cluster, incident: str) -> None:
    reason = f"trainmedic {incident}: gpu_hardware | gpu reset (RESET_GPU)"
    _sh(cluster, "scontrol", "update", f"nodename={NODE}", "state=drain", f"reason={reason}")
    backend = SlurmCliBackend(cluster.runner())
    wait_for(f"{NODE} drained", lambda: backend.node_state(NODE).drained, timeout=30)


def test_a_busy_gpu_is_refused_after_the_idle_timeout_and_another_incidents_command_at_once(
    broker: EmbeddedBroker, cluster: Cluster, tmp_path: Path
) -> None:
    incident = f"inc-busy{int(time.time())}"
    _drain_as_trainmedic(cluster, incident)
    agent = Agent(cluster, broker.bootstrap, tmp_path / "agent", processes={"2": [[4242, 1 << 30]]})
    pub = Publisher(broker.bootstrap, "test-executor")
    try:
        agent.start(idle_timeout=3)
        t0 = time.monotonic()
        pub.publish_sync(NODE_COMMANDS, _command("inc-someoneelse", action="act-other"))
        pub.publish_sync(NODE_COMMANDS, _command(incident, gpu=None))
        results = wait_for("two results", lambda: (r := _results(broker.bootstrap, 1.0))[1:] and r, timeout=60)
        other, busy = results
        assert other.status == "refused" and other.incident_id == "inc-someoneelse"
        assert f"{NODE} is drained for {incident} now" in other.detail
        assert busy.status == "refused" and busy.gpu is None
        assert busy.detail.startswith("not idle within the idle timeout of 3 s; last seen: GPU 2: compute process 4242")
        assert busy.finished_at - busy.started_at >= 3 and time.monotonic() - t0 >= 3
        assert agent.reset_calls() == []
        assert backend_drained(cluster)  # refused: the node stays as it was, for a person
    finally:
        pub.close()
        agent.stop()


def backend_drained(cluster: Cluster) -> bool:
    return SlurmCliBackend(cluster.runner()).node_state(NODE).drained


def test_an_agent_killed_during_the_reset_never_runs_it_again_and_says_failed(
    broker: EmbeddedBroker, cluster: Cluster, tmp_path: Path
) -> None:
    incident = f"inc-kill{int(time.time())}"
    _drain_as_trainmedic(cluster, incident)
    agent = Agent(cluster, broker.bootstrap, tmp_path / "agent")
    pub = Publisher(broker.bootstrap, "test-executor")
    try:
        # The reset script kills the agent that runs it (its parent) before it reports anything.
        agent.start(script_body="kill -9 $PPID")
        pub.publish_sync(NODE_COMMANDS, _command(incident))
        assert agent.launched is not None
        wait_for("the agent gone", lambda: agent.launched is not None and agent.launched.proc.poll() is not None, 60)
        assert agent.reset_calls() == ["-i 2"] and _results(broker.bootstrap) == []
        agent.launched = None
        agent.start()  # the same state folder: it says the reset was begun
        (failed,) = wait_for("the result", lambda: _results(broker.bootstrap, 1.0), timeout=60)
        assert failed.status == "failed" and "stopped while the reset command ran: not run again" in failed.detail
        assert agent.reset_calls() == ["-i 2"]
    finally:
        pub.close()
        agent.stop()
