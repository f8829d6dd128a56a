"""Start a deployable's command as its unit or container would, and wait until it says ready.

Used by the chart and systemd start tests: the command and environment are the rendered ones;
the probe listener is the one the command serves (`/readyz` on its metrics address). A command
that exits first fails the test with its output, so a missing option or setting shows as such.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson


@dataclass
class Launched:
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self, last: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-last:]


class NotReady(AssertionError):
    pass


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files for 127.0.0.1 and localhost, valid a day (openssl's command)."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def probe(url: str, timeout: float = 2.0) -> tuple[int, dict[str, object] | None]:
    """(status, JSON body) of a probe endpoint; (0, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, orjson.loads(exc.read())
        except orjson.JSONDecodeError:
            return exc.code, None
    except (OSError, orjson.JSONDecodeError):
        return 0, None


def start(argv: Sequence[str], env: Mapping[str, str], log: Path, cwd: Path | None = None) -> Launched:
    out = open(log, "wb")  # noqa: SIM115 - the child writes it until it is stopped
    proc = subprocess.Popen(
        list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
    )
    out.close()
    return Launched(list(argv), proc, log)


def wait_ready(launched: Launched, ready_url: str, timeout: float = 120.0) -> dict[str, object]:
    """Poll `ready_url` until it answers 200; NotReady with the command's output if it exits or times out."""
    deadline = time.monotonic() + timeout
    last: tuple[int, dict[str, object] | None] = (0, None)
    while time.monotonic() < deadline:
        if launched.proc.poll() is not None:
            raise NotReady(
                f"{' '.join(launched.argv)} exited with {launched.proc.returncode} before it was ready:\n"
                f"{launched.output()}"
            )
        last = probe(ready_url)
        if last[0] == 200 and last[1] is not None:
            return last[1]
        time.sleep(0.3)
    raise NotReady(
        f"{' '.join(launched.argv)} not ready at {ready_url} within {timeout:.0f} s (last answer {last}):\n"
        f"{launched.output()}"
    )


def stop(launched: Launched, timeout: float = 30.0) -> int:
    """SIGTERM (what Kubernetes and systemd send), then SIGKILL; the exit status."""
    if launched.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launched.proc.pid, signal.SIGTERM)
        try:
            launched.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launched.proc.pid, signal.SIGKILL)
            launched.proc.wait(10)
    return launched.proc.returncode


@contextlib.contextmanager
def running(
    argv: Sequence[str], env: Mapping[str, str], log: Path, ready_url: str, timeout: float = 120.0
) -> Iterator[tuple[Launched, dict[str, object]]]:
    """Started and ready for the body; stopped after it, whatever happens."""
    launched = start(argv, env, log)
    try:
        yield launched, wait_ready(launched, ready_url, timeout)
    finally:
        stop(launched)
