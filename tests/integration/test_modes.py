"""Mode changes reach every streams process through mode.changes, and fail closed.

Real broker: each ModeState follows the whole topic (two of them both see every change);
a worker that has neither the durable state file nor the whole topic is in doubt (monitor);
a refused, unreadable or other cluster's change never raises autonomy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bus.consume import Follower, MissingTopic
from bus.publish import Publisher
from schemas.events import ModeChange
from schemas.topics import MODE_CHANGES
from streams.modes import ModeState
from streams.policy import DEFAULT_POLICY, ModeOverlay, save_overlay
from tests.conftest import wait_for
from trainmedic.broker import EmbeddedBroker


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
