"""The streams of GPU samples a detector of `gpu.samples` keeps: one per node and producer.

Shared by the GPU-health and the pre-failure detectors, which both judge each GPU from its
readings over time. A redelivered sample (the same event id) gives the same output again; a
sample older than the stream's last is dropped (its counters would read as a reset, then a
rise); a GPU missing from a sample loses its state, and a slot whose GPU changed (another UUID)
starts a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from schemas.events import GpuMetrics, GpuSample


class GpuState(Protocol):
    uuid: str | None


S = TypeVar("S", bound=GpuState)  # what a detector keeps per GPU
Out = TypeVar("Out")  # what a sample yields


@dataclass
class SampleStream(Generic[S, Out]):
    """One producer's samples of one node."""

    last_id: str = ""
    last_time: float = float("-inf")
    last_out: list[Out] = field(default_factory=list)
    gpus: dict[int, S] = field(default_factory=dict)


class GpuSampleStreams(Generic[S, Out]):
    def __init__(self, new_state: Callable[[str | None], S]) -> None:
        self._new_state = new_state
        self.streams: dict[tuple[str, str], SampleStream[S, Out]] = {}

    def observe(self, sample: GpuSample, per_gpu: Callable[[GpuSample, S, GpuMetrics], list[Out]]) -> list[Out]:
        """`per_gpu(sample, state, gpu)` for each GPU of the sample (the first of a repeated index)."""
        stream = self.streams.setdefault((sample.node, sample.collector), SampleStream())
        if sample.event_id == stream.last_id:
            return list(stream.last_out)
        if sample.event_time <= stream.last_time:
            return []
        out: list[Out] = []
        present: set[int] = set()
        for gpu in sample.gpus:
            if gpu.index in present:
                continue
            present.add(gpu.index)
            out.extend(per_gpu(sample, self._slot(stream, gpu), gpu))
        for index in [i for i in stream.gpus if i not in present]:
            del stream.gpus[index]
        stream.last_id, stream.last_time, stream.last_out = sample.event_id, sample.event_time, out
        return list(out)

    def _slot(self, stream: SampleStream[S, Out], gpu: GpuMetrics) -> S:
        state = stream.gpus.get(gpu.index)
        if state is None or (gpu.uuid and state.uuid and gpu.uuid != state.uuid):
            # A new GPU in the slot, or the first sight of it: a new baseline.
            state = self._new_state(gpu.uuid)
            stream.gpus[gpu.index] = state
        state.uuid = gpu.uuid or state.uuid
        return state

    def states(self, node: str | None = None) -> Iterator[S]:
        """Every GPU's state, or those of one node (over every producer of the node)."""
        for (n, _), stream in self.streams.items():
            if node is None or n == node:
                yield from stream.gpus.values()

    def forget(self, node: str) -> None:
        for key in [k for k in self.streams if k[0] == node]:
            del self.streams[key]
