"""Producers' liveness (producers.metrics.ProducerHealth over bus.health), their counters, the
kernel stream readers' idle wake-ups, and `produce gpu` on a host without NVML."""

from __future__ import annotations

import os
import resource
import sys
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from bus import health
from bus.metrics import MirroredCounter
from producers import metrics
from producers.kernel import _lines_of
from producers.metrics import FAIL_AFTER, ProducerHealth, stale_after


@pytest.fixture(autouse=True)
def clean_loops() -> Iterator[None]:
    health.forget_all()
    yield
    health.forget_all()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_producer_is_ready_after_its_first_good_poll_and_not_after_failing_ones() -> None:
    h = ProducerHealth("unit", interval_s=1.0)
    assert health.report()["ready"] is False  # registered, not yet polled
    h.failed("exporter refused")
    assert not h.loop.ready and h.loop.why == "exporter refused"  # never ready: the first failure says why
    h.ok(3, "scraping")
    assert h.loop.ready and health.report()["ready"]
    assert h.loop.processed == 3 and sample("trainmedic_loop_ready", loop="producer-unit") == 1
    for _ in range(FAIL_AFTER - 1):
        h.failed("exporter refused")
    assert h.loop.ready  # a blip does not flap readiness
    h.failed("exporter refused")
    assert not h.loop.ready and f"{FAIL_AFTER} in a row" in h.loop.why
    assert h.loop.alive  # failing polls still go round: alive, not ready
    h.ok()
    assert h.loop.ready
    h.stop()
    assert "producer-unit" not in health.loops()


def test_idle_rounds_beat_without_counting_records() -> None:
    h = ProducerHealth("idle", interval_s=5.0)
    h.idle()
    assert h.loop.last_beat is not None and h.loop.last_processed is None and not h.loop.ready


def test_stale_after_leaves_room_for_a_slow_round() -> None:
    assert stale_after(1.0) == 60.0
    assert stale_after(30.0) == 150.0
    # Slurm: three commands of 30 s and a 10 s flush in one round.
    assert stale_after(5.0, 100.0) == 105.0


def test_mirrored_counter_counts_in_both() -> None:
    counts = MirroredCounter(metrics.INGEST_REJECTED, "unit-ingest")
    before = sample("trainmedic_producer_ingest_rejected_total", producer="unit-ingest", reason="too_large")
    counts["too_large"] += 1
    counts["too_large"] += 2
    assert counts["too_large"] == 3
    after = sample("trainmedic_producer_ingest_rejected_total", producer="unit-ingest", reason="too_large")
    assert after - before == 3


def test_a_pipe_reader_wakes_when_idle_and_splits_lines_across_reads() -> None:
    r, w = os.pipe()
    got: list[str | None] = []
    reader = _lines_of(r, idle_s=0.05)
    assert next(reader) is None  # nothing written: an idle wake-up, not a block
    os.write(w, b'{"a": 1}\n{"b"')
    got.append(next(reader))
    os.write(w, b": 2}\n")
    got.append(next(reader))
    os.close(w)
    got += list(reader)
    os.close(r)
    assert [g for g in got if g is not None] == ['{"a": 1}\n', '{"b": 2}\n']


def test_a_pipe_reader_without_idle_blocks_until_data() -> None:
    r, w = os.pipe()
    out: list[str | None] = []
    t = threading.Thread(target=lambda: out.extend(_lines_of(r, None)))
    t.start()
    os.write(w, b"x\ny")
    os.close(w)
    t.join(30)
    os.close(r)
    assert out == ["x\n", "y"]


def _produce_gpu() -> tuple[int, str]:
    from trainmedic.cli.main import app

    # Kafka that cannot answer: NVML must be checked, and refused, first.
    result = CliRunner().invoke(app, ["produce", "gpu", "--bootstrap", "127.0.0.1:1"])
    return result.exit_code, result.output


def test_produce_gpu_without_the_nvml_library_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    import producers.gpu_nvml as nvml

    def no_library(*_: object, **__: object) -> None:
        raise nvml.NvmlUnavailable(
            f"NVML unavailable: {pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)} "
            f"({nvml._INIT_HINTS[pynvml.NVML_ERROR_LIBRARY_NOT_FOUND]})"
        )

    monkeypatch.setattr(nvml, "NvmlCollector", no_library)
    code, output = _produce_gpu()
    assert code == 3, output
    assert "NVML is not available on this host" in output and "produce dcgm" in output
    assert "Traceback" not in output and "Kafka" not in output and "Usage:" not in output


def test_produce_gpu_without_the_nvml_bindings_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "producers.gpu_nvml", None)  # import raises ImportError
    code, output = _produce_gpu()
    assert code == 3, output
    assert "NVML is not available on this host" in output and "nvidia-ml-py" in output


def test_a_pipe_reader_works_on_a_descriptor_numbered_past_1024() -> None:
    """A busy process (many sockets and files) hands out descriptors past select()'s 1024."""
    r, w = os.pipe()
    # A free one: dup2 onto a descriptor an earlier test's thread still holds would close it under
    # that thread, whose later close() then closes this pipe (seen in the clean-clone CI, where
    # the suite's one process had passed 1,500 descriptors).
    high = next(fd for fd in range(1500, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) if not _is_open(fd))
    os.dup2(r, high)
    os.close(r)
    try:
        reader = _lines_of(high, idle_s=0.05)
        assert next(reader) is None
        os.write(w, b"late line\n")
        assert next(reader) == "late line\n"
        os.close(w)
        assert list(reader) == []
    finally:
        os.close(high)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
