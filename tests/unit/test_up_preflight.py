"""`up`'s refusals before it starts anything: the operator API off loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sinks.backends.simulated import SimulatedScheduler
from trainmedic.stack.broker import free_port
from trainmedic.stack.runtime import Stack, StackConfig, StackError


def _stack(tmp_path: Path, **kw: Any) -> Stack:
    return Stack(StackConfig(data_dir=tmp_path, api_port=free_port(), **kw), SimulatedScheduler([]))


def test_the_api_off_loopback_needs_tls_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="serves TLS"):
        _stack(tmp_path, api_host="0.0.0.0").preflight()
    _stack(tmp_path, api_host="0.0.0.0", api_insecure=True).preflight()
    cert, key = tmp_path / "api.crt", tmp_path / "api.key"
    with pytest.raises(StackError, match="go together"):
        _stack(tmp_path, api_host="0.0.0.0", api_tls_cert=cert).preflight()
    with pytest.raises(StackError, match="api_tls_cert .*no such file"):
        _stack(tmp_path, api_host="0.0.0.0", api_tls_cert=cert, api_tls_key=key).preflight()
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    _stack(tmp_path, api_host="0.0.0.0", api_tls_cert=cert, api_tls_key=key).preflight()


def test_worker_metrics_ports_pass_over_the_stacks_other_listeners(tmp_path: Path) -> None:
    # `up`'s defaults: workers from 9478, its own listener 9479, the API 8477.
    def stack(workers: int, api_port: int) -> Stack:
        config = StackConfig(
            data_dir=tmp_path, api_port=api_port, workers=workers, worker_metrics_port=9478, metrics_port=9479
        )
        return Stack(config, SimulatedScheduler([]))

    assert stack(3, 8477).worker_metrics_ports() == [9478, 9480, 9481]
    assert stack(3, 8477).worker_metrics_ports(4)[3] == 9482  # a worker started beyond the configured ones
    assert stack(1, 9479).worker_metrics_ports() == [9478]
    assert stack(2, 9480).worker_metrics_ports() == [9478, 9481]
    assert Stack(StackConfig(data_dir=tmp_path, workers=2), SimulatedScheduler([])).worker_metrics_ports() == []
    with pytest.raises(StackError, match="no room for 3 worker ports"):
        Stack(StackConfig(data_dir=tmp_path, workers=3, worker_metrics_port=65534), SimulatedScheduler([])).preflight()
