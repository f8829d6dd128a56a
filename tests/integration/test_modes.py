"""Mode changes reach every streams process through mode.changes, and fail closed.

Real broker: each ModeState follows the whole topic (two of them both see every change);
a worker that has neither the durable state file nor the whole topic is in doubt (monitor);
a refused, unreadable or other cluster's change never raises autonomy. The brake always works:
with the policy file broken, `trainmedic mode set monitor` still switches (the API keeps the
last good policy) and /api/health names the file as degraded until it is fixed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus.consume import Follower, MissingTopic
from bus.publish import Publisher
from schemas.events import ModeChange
from schemas.topics import MODE_CHANGES
from sinks.backends.simulated import SimulatedScheduler
from streams.modes import ModeState
from streams.policy import DEFAULT_POLICY, ModeOverlay, save_overlay
from tests.conftest import wait_for
from trainmedic.cli.client import call
from trainmedic.stack.broker import EmbeddedBroker
from trainmedic.stack.runtime import Stack, StackConfig


def _change(n: int, mode: str = "autonomous", partition: str | None = "gpu", **kw: object) -> ModeChange:
    return ModeChange(
        event_id=f"mode-{n}",
        event_time=time.time(),
        partition=partition,
        new_mode=mode,  # type: ignore[arg-type]
        operator="alice",
        **kw,  # type: ignore[arg-type]
    )


def test_every_worker_sees_every_change(broker: EmbeddedBroker) -> None:
    pub = Publisher(broker.bootstrap)
    pub.publish(MODE_CHANGES, _change(1))
    pub.publish(MODE_CHANGES, _change(2, "monitor", partition=None))
    assert pub.flush(10) == 0
    a, b = ModeState(broker.bootstrap), ModeState(broker.bootstrap)
    try:
        assert a.in_doubt and b.in_doubt  # nothing read yet, no state file
        for state in (a, b):
            wait_for("the topic read to its end", _caught_up(state), timeout=30)
            assert state.overlay.partitions["gpu"].mode == "autonomous"
            assert state.overlay.mode == "monitor"
        # A later change reaches both, not one member of a group.
        pub.publish(MODE_CHANGES, _change(3, "monitor"))
        assert pub.flush(10) == 0
        for state in (a, b):
            wait_for("the new change", _gpu_mode_is(state, "monitor"))
    finally:
        a.close()
        b.close()
        pub.close()


def test_refused_foreign_and_unreadable_changes_are_not_applied(broker: EmbeddedBroker) -> None:
    pub = Publisher(broker.bootstrap)
    pub.publish(MODE_CHANGES, _change(1, outcome="refused"))
    pub.publish(MODE_CHANGES, _change(2, cluster="east"))
    pub.publish_raw(MODE_CHANGES.name, b'{"schema_version": 2, "new_mode": "autonomous"}', b"gpu")
    pub.publish(MODE_CHANGES, _change(3, "monitor", partition="cpu"))
    assert pub.flush(10) == 0
    state = ModeState(broker.bootstrap)
    try:
        wait_for("the topic read", lambda: (state.poll(), "cpu" in state.overlay.partitions)[1], timeout=30)
        assert "gpu" not in state.overlay.partitions
        assert state.overlay.mode is None
    finally:
        state.close()
        pub.close()


def test_state_file_is_the_record_when_the_topic_is_gone(tmp_path: Path) -> None:
    overlay = ModeOverlay()
    overlay.categories["gpu_hardware"] = "autonomous"
    save_overlay(tmp_path / "modes.yaml", overlay)
    # The broker is gone (memory-only, restarted, or not there): nothing to follow.
    durable = ModeState("127.0.0.1:1", tmp_path / "modes.yaml", follower=_no_topic)
    assert durable.poll() == 0
    assert not durable.in_doubt
    assert durable.overlay.categories["gpu_hardware"] == "autonomous"
    # No file and no topic: in doubt (the policy store then runs everything in monitor mode).
    blind = ModeState("127.0.0.1:1", tmp_path / "absent.yaml", follower=_no_topic)
    assert blind.poll() == 0 and blind.in_doubt
    # An unreadable file is no record.
    (tmp_path / "bad.yaml").write_text("mode: [\n")
    assert ModeState("127.0.0.1:1", tmp_path / "bad.yaml", follower=_no_topic).in_doubt


def _caught_up(state: ModeState) -> Callable[[], bool]:
    return lambda: (state.poll(), not state.in_doubt)[1]


def _gpu_mode_is(state: ModeState, mode: str) -> Callable[[], bool]:
    return lambda: (state.poll(), state.overlay.partitions["gpu"].mode == mode)[1]


def _no_topic() -> Follower:
    raise MissingTopic("cannot read topic mode.changes: broker down")


def test_a_worker_in_doubt_decides_as_in_monitor_mode(tmp_path: Path) -> None:
    from streams.policy_store import PolicyStore

    policy = tmp_path / "policy.yaml"
    default = DEFAULT_POLICY.read_text()
    policy.write_text(default.replace("\nmode: monitor\n", "\nmode: autonomous\n", 1))
    blind = ModeState("127.0.0.1:1", None, follower=_no_topic)
    store = PolicyStore(policy, modes=blind)
    assert store.policy.mode_for("gpu", "gpu_hardware") == "monitor"
    # Once the durable record is known, the policy file's modes (under the operators') apply.
    save_overlay(tmp_path / "modes.yaml", ModeOverlay())
    durable = PolicyStore(policy, modes=ModeState("127.0.0.1:1", tmp_path / "modes.yaml", follower=_no_topic))
    assert durable.policy.mode_for("gpu", "gpu_hardware") == "autonomous"
    # Offline (no operator modes at all: diagnose, replay) the policy file decides.
    assert PolicyStore(policy).policy.mode_for("gpu", "gpu_hardware") == "autonomous"


def _health(api_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{api_url}/api/health", timeout=10) as r:
        assert r.status == 200
        return json.loads(r.read())  # type: ignore[no-any-return]


def _rewrite(path: Path, text: str) -> None:
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # changed, even within one timestamp tick


def test_the_brake_works_with_a_broken_policy_file(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    good = DEFAULT_POLICY.read_text()
    policy.write_text(good)
    stack = Stack(
        StackConfig(
            data_dir=tmp_path,
            bootstrap=broker.bootstrap,
            clickhouse=chdb_url,
            database=database,
            policy=policy,
            api_port=0,
        ),
        SimulatedScheduler(["gpu01", "gpu02"]),
    ).start()
    try:
        assert stack.api is not None
        url, token = stack.api.url, (tmp_path / "api-token").read_text().strip()
        promoted = {"mode": "autonomous", "partition": "gpu", "operator": "alice", "force": True}
        assert call(url, token, "POST", "/api/modes", promoted)["new_mode"] == "autonomous"
        assert "degraded" not in _health(url)
        # A duplicate key (PyYAML would keep the last one silently; the loader refuses the file).
        _rewrite(policy, good.replace("\nmode: monitor\n", "\nmode: monitor\nmode: autonomous\n", 1))
        line = good.split("\nmode: monitor\n", 1)[0].count("\n") + 3
        brake = subprocess.run(
            [sys.executable, "-m", "trainmedic.cli.main", "mode", "set", "monitor", "--partition", "gpu"]
            + ["--reason", "brake", "--operator", "bob", "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert brake.returncode == 0, brake.stderr
        assert "autonomous -> monitor" in brake.stdout
        assert (
            f"{policy.resolve()}: line {line}: duplicate key 'mode'" in brake.stderr
        )  # the warning: the file is not in force
        modes = call(url, token, "GET", "/api/modes")
        assert modes["partitions"]["gpu"]["mode"] == "monitor" and modes["mode"] == "monitor"
        assert call(url, token, "GET", "/api/readiness")  # 200, under the last good policy
        degraded = _health(url)["degraded"]["policy"]
        assert f"{policy.resolve()}: line {line}: duplicate key 'mode'" in degraded and "stays in force" in degraded
        _rewrite(policy, good)
        assert "degraded" not in _health(url)
    finally:
        stack.stop()
