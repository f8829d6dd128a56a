"""/dev/kmsg read for real: after a restart the producer skips what it handled, by sequence number."""

from __future__ import annotations

import os
import uuid

import pytest

from producers.kernel import read_kmsg

KMSG = "/dev/kmsg"
pytestmark = pytest.mark.skipif(
    not (os.access(KMSG, os.R_OK) and os.access(KMSG, os.W_OK)), reason="/dev/kmsg not readable and writable (root)"
)


def _write(text: str) -> None:
    with open(KMSG, "w") as fh:  # a user-space record in the kernel ring buffer
        fh.write(text + "\n")


def _seq_of(marker: str, after: int | None) -> int:
    for message, seq in read_kmsg(after_seq=after, lookback_s=3600):
        if marker in message:
            assert seq is not None
            return seq
    raise AssertionError("unreachable: read_kmsg blocks for new records")


def test_a_restart_reads_on_after_the_last_sequence_number_handled() -> None:
    tag = uuid.uuid4().hex[:8]
    _write(f"trainmedic-test {tag} first")
    first = _seq_of(f"{tag} first", None)  # in the ring buffer already: the look-back finds it
    _write(f"trainmedic-test {tag} second")  # written "while the producer was away"
    seen = []
    for message, seq in read_kmsg(after_seq=first, lookback_s=3600):
        seen.append(message)
        if f"{tag} second" in message:
            assert seq is not None and seq > first
            break
    assert not any(f"{tag} first" in m for m in seen)
