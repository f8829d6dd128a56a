"""The service gauges an SRE alerts on: the mode each partition decides in (streams.metrics)
and the executor's kill switch (sinks.metrics), read back from the Prometheus registry."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client import REGISTRY

from schemas.vocab import CATEGORIES
from sinks.guardrails import GuardrailFile, Guardrails, GuardrailSettings
from streams.metrics import show_modes
from streams.modes import apply_change
from streams.policy import DEFAULT_POLICY, ModeOverlay, load_policy


def mode_of(partition: str) -> str | None:
    on = [
        m
        for m in ("monitor", "autonomous")
        if REGISTRY.get_sample_value("trainmedic_mode", {"partition": partition, "mode": m}) == 1
    ]
    assert len(on) <= 1, on
    return on[0] if on else None


def autonomous(partition: str) -> float | None:
    return REGISTRY.get_sample_value("trainmedic_autonomous_categories", {"partition": partition})


def test_mode_gauges_follow_the_operators_changes_and_fall_back_to_monitor_in_doubt() -> None:
    base = load_policy(DEFAULT_POLICY).with_mode("monitor")
    overlay = ModeOverlay()
    apply_change(overlay, "gpu-a", None, "autonomous")
    apply_change(overlay, "gpu-b", "oom", "autonomous")
    show_modes(base.with_overlay(overlay))
    assert (mode_of("*"), mode_of("gpu-a"), mode_of("gpu-b")) == ("monitor", "autonomous", "monitor")
    assert autonomous("gpu-a") == len(CATEGORIES) and autonomous("gpu-b") == 1 and autonomous("*") == 0
    # In doubt the worker decides by a monitor-everywhere policy that names no partition: the
    # partitions shown before stay, in monitor, rather than vanishing from the dashboards.
    show_modes(base.with_mode("monitor"))
    assert (mode_of("gpu-a"), mode_of("gpu-b")) == ("monitor", "monitor")
    assert autonomous("gpu-a") == 0 and autonomous("gpu-b") == 0


def _write(policy: Path, on: bool) -> None:
    policy.write_text(f"guardrails:\n  kill_switch: {'true' if on else 'false'}\n")
    # A later mtime than the last read, however coarse the file system's clock.
    stamp = time.time() + (2 if on else 4)
    os.utime(policy, (stamp, stamp))


def test_the_kill_switch_gauge_reads_the_policy_file_at_scrape_time(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    _write(policy, on=False)
    # The kill switch needs no scheduler: no backend.
    rails = Guardrails(GuardrailFile(policy), backend=None)  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value("trainmedic_kill_switch") == 0
    _write(policy, on=True)  # flipped while the executor is idle: no check() in between
    assert REGISTRY.get_sample_value("trainmedic_kill_switch") == 1
    assert rails.settings().kill_switch


def test_a_replays_what_if_guardrails_do_not_move_the_gauge(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    _write(policy, on=False)
    executor_rails = Guardrails(GuardrailFile(policy), backend=None)  # type: ignore[arg-type]
    Guardrails(lambda: GuardrailSettings(kill_switch=True), backend=None)  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value("trainmedic_kill_switch") == 0
    del executor_rails
