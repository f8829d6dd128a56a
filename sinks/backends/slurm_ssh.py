"""SSH mode: the Slurm CLI backend with its commands run on a login node over SSH.

``SshRunner`` is a slurmio ``Runner`` (``(argv, timeout) -> stdout``, raising
SlurmCommandError naming the command) that keeps one asyncssh connection open
and runs each argv as one remote command. Its transport errors (`SshError`)
are both BackendError and SlurmCommandError, so the backends and the
producers, which take any slurmio runner, handle them alike.

Security properties, all enforced here rather than left to configuration:

* Host keys are checked strictly against the given known_hosts file. A missing
  or non-matching key refuses the connection before authentication, so nothing
  runs; there is no trust-on-first-use and no way to turn checking off.
* Only public-key auth with the given private key: no agent, no ~/.ssh/config,
  no default identities, no passwords, no forwarding.
* The remote side always runs the user's login shell, so argv cannot be passed
  through as-is: every element is ``shlex.quote``-d (POSIX sh quoting: the
  login user needs a POSIX shell) and argv[0] must be one of the Slurm binaries
  the backend uses. Node names and reasons come from untrusted events.
* Key contents and passphrases are never stored on the runner, logged or put
  into error messages: the key is decrypted once at construction.

The executor calls backends from a plain thread, so the runner is synchronous:
it drives asyncssh on a private event loop in a dedicated daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import stat
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import asyncssh

from sinks.backends.base import BackendError
from sinks.backends.slurm_cli import SlurmCliBackend
from slurmio.runners import SlurmCommandError

__all__ = [
    "ALLOWED_COMMANDS",
    "SlurmSshBackend",
    "SshAuthError",
    "SshError",
    "SshHostKeyError",
    "SshRunner",
    "slurm_ssh_backend",
]

log = logging.getLogger(__name__)

ALLOWED_COMMANDS = frozenset({"scontrol", "squeue", "sinfo", "scancel", "sbatch"})

_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# Exit codes a POSIX shell / env(1) use for "command not found" / "not executable".
_NOT_RUN_CODES = (126, 127)
# Extra seconds the calling thread waits beyond the coroutine's own timeouts, so
# that the coroutine's clearer error normally wins over the safety net.
_SAFETY_MARGIN_S = 5.0

_T = TypeVar("_T")


class SshError(BackendError, SlurmCommandError):
    """The SSH transport failed (connect, login, lost link, timeout); the message says whether it ran."""


class SshHostKeyError(SshError):
    """The server's host key is not in known_hosts (or differs): nothing was run."""


class SshAuthError(SshError):
    """The server refused our key: nothing was run."""


class SshRunner:
    """Runs Slurm commands on a remote host over one reused SSH connection."""

    def __init__(
        self,
        host: str,
        port: int,
        user: str,
        key_path: str | os.PathLike[str],
        known_hosts: str | os.PathLike[str],
        *,
        slurm_conf: str | None = None,
        passphrase: str | None = None,
        connect_timeout: float = 10.0,
        keepalive_interval: float = 30.0,
        slurm_bin_dir: str | None = None,
    ) -> None:
        if not isinstance(host, str) or _HOST_RE.fullmatch(host) is None:
            raise ValueError(f"invalid SSH host {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"invalid SSH port {port!r}")
        if not isinstance(user, str) or _USER_RE.fullmatch(user) is None:
            raise ValueError(f"invalid SSH user {user!r}")
        if connect_timeout <= 0:
            raise ValueError("connect_timeout must be positive")
        if slurm_conf is not None:
            _check_remote_path("slurm_conf", slurm_conf)
        if slurm_bin_dir is not None:
            _check_remote_path("slurm_bin_dir", slurm_bin_dir)

        self.host = host
        self.port = port
        self.user = user
        self.key_path = str(key_path)
        self.known_hosts = str(known_hosts)
        self.slurm_conf = slurm_conf
        self.slurm_bin_dir = (slurm_bin_dir.rstrip("/") or "/") if slurm_bin_dir is not None else None
        self.connect_timeout = float(connect_timeout)
        self.keepalive_interval = float(keepalive_interval)
        #: Successful SSH logins so far; reuse keeps this at 1 while the link stays up.
        self.connections_opened = 0

        self._key = _load_private_key(self.key_path, passphrase)
        _check_known_hosts(self.known_hosts)

        self._thread_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conn: asyncssh.SSHClientConnection | None = None
        self._conn_lock: asyncio.Lock | None = None
        self._closed = False

    def __repr__(self) -> str:
        # Deliberately leaves out the key object: its repr is not ours to vet.
        return (
            f"SshRunner({self.user}@{self.host}:{self.port}, key={self.key_path!r}, "
            f"known_hosts={self.known_hosts!r}, slurm_conf={self.slurm_conf!r})"
        )

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    # ------------------------------------------------------------------ commands
    def remote_command(self, argv: Sequence[str]) -> str:
        """The exact string the remote shell gets for ``argv`` (every element quoted).

        Raises ValueError for anything that is not a call of an allowed Slurm binary.
        """
        args = [str(a) for a in argv]
        if not args:
            raise ValueError("empty command")
        if args[0] not in ALLOWED_COMMANDS:
            raise ValueError(f"refusing to run {args[0]!r} over SSH: only {', '.join(sorted(ALLOWED_COMMANDS))}")
        for a in args:
            if "\x00" in a:  # a shell word cannot hold NUL: it would be cut there
                raise ValueError(f"NUL byte in argument {a!r}")
        binary = f"{self.slurm_bin_dir}/{args[0]}" if self.slurm_bin_dir else args[0]
        # env(1) sets variables without the shell parsing them; LC_ALL=C keeps
        # messages parseable, as LocalRunner does.
        prefix = ["env", "LC_ALL=C"]
        if self.slurm_conf is not None:
            prefix.append(f"SLURM_CONF={self.slurm_conf}")
        return shlex.join([*prefix, binary, *args[1:]])

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        args = tuple(str(a) for a in argv)
        command = self.remote_command(args)
        shown = shlex.join(args)
        log.debug("ssh %s: %s", self.target, shown)
        budget = timeout + 2 * self.connect_timeout + _SAFETY_MARGIN_S
        return self._submit(self._run(args, command, timeout), budget, f"{shown} over SSH to {self.target}")

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Open the connection now (otherwise the first command does it)."""
        self._submit(self._connection(), self.connect_timeout + _SAFETY_MARGIN_S, f"SSH connect to {self.target}")

    def close(self) -> None:
        """Close the connection and stop the loop thread. Idempotent."""
        with self._thread_lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        # Best effort: the loop is stopped below either way.
        with contextlib.suppress(TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(self._drop_connection(), loop).result(timeout=self.connect_timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=self.connect_timeout)

    def __enter__(self) -> SshRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._thread_lock:
            if self._closed:
                raise SshError(f"SSH runner for {self.target} is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_serve_loop, args=(loop,), name=f"trainmedic-ssh-{self.host}:{self.port}", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _submit(self, coro: Coroutine[Any, Any, _T], budget: float, what: str) -> _T:
        try:
            loop = self._ensure_loop()
        except BaseException:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout=budget)
        except TimeoutError as exc:  # concurrent.futures.TimeoutError is this builtin since 3.11
            if future.done():  # the coroutine's own TimeoutError, not our wait running out
                raise SshError(f"{what}: {type(exc).__name__}: {exc}") from exc
            future.cancel()
            raise SshError(f"{what}: no answer after {budget:g}s") from exc

    async def _connection(self) -> asyncssh.SSHClientConnection:
        if self._conn_lock is None:  # created here so it belongs to the runner's loop
            self._conn_lock = asyncio.Lock()
        async with self._conn_lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            if self._conn is not None:
                log.info("ssh %s: connection was closed; reconnecting", self.target)
                self._conn = None
            self._conn = await self._open()
            return self._conn

    async def _open(self) -> asyncssh.SSHClientConnection:
        try:
            conn = await asyncssh.connect(
                self.host,
                self.port,
                username=self.user,
                # Strict checking: a path is re-read on every connect, so rotating
                # the file takes effect on reconnect. Never None (= accept any key).
                known_hosts=self.known_hosts,
                client_keys=[self._key],
                config=[],  # ignore ~/.ssh/config: only what was configured here applies
                agent_path=None,
                agent_forwarding=False,
                x11_forwarding=False,
                x509_trusted_certs=None,
                preferred_auth="publickey",
                password_auth=False,
                kbdint_auth=False,
                host_based_auth=False,
                gss_auth=False,
                gss_kex=False,
                connect_timeout=self.connect_timeout,
                login_timeout=self.connect_timeout,
                keepalive_interval=self.keepalive_interval,
            )
        except asyncssh.HostKeyNotVerifiable as exc:
            raise SshHostKeyError(
                f"SSH host key of {self.host}:{self.port} is not trusted by known_hosts file "
                f"{self.known_hosts} (expected an entry for {_known_hosts_name(self.host, self.port)}); "
                f"refusing to connect, nothing was run: {exc.reason}"
            ) from None
        except asyncssh.PermissionDenied as exc:
            raise SshAuthError(
                f"SSH login as {self.target} with key {self.key_path} was refused; nothing was run: {exc.reason}"
            ) from None
        except (TimeoutError, asyncssh.Error, OSError) as exc:
            raise SshError(
                f"SSH connect to {self.target} failed; nothing was run: {type(exc).__name__}: {_reason(exc)}"
            ) from None
        self.connections_opened += 1
        log.info("ssh %s: connected (connection #%d)", self.target, self.connections_opened)
        return conn

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            with contextlib.suppress(TimeoutError, asyncssh.Error, OSError):
                await asyncio.wait_for(conn.wait_closed(), self.connect_timeout)

    async def _run(self, args: tuple[str, ...], command: str, timeout: float) -> str:
        shown = shlex.join(args)
        for attempt in (1, 2):
            conn = await self._connection()
            try:
                result = await conn.run(command, check=False, stdin=asyncssh.DEVNULL, timeout=timeout)
            except asyncssh.ChannelOpenError as exc:
                # The channel never opened, so the command was never sent: a stale
                # connection (server restarted, link cut) is safe to replace once.
                await self._forget(conn)
                if attempt == 1:
                    log.info("ssh %s: channel open failed (%s); retrying on a new connection", self.target, exc.reason)
                    continue
                raise SshError(f"{shown} could not be run over SSH to {self.target}: {exc.reason}") from None
            except asyncssh.TimeoutError as exc:
                raise SshError(f"{shown} timed out after {timeout:g}s over SSH to {self.target}") from exc
            except (asyncssh.Error, OSError) as exc:
                # Lost mid-command: it may or may not have run; the caller verifies state.
                await self._forget(conn)
                raise SshError(
                    f"{shown}: SSH connection to {self.target} lost while running; outcome unknown: {_reason(exc)}"
                ) from None
            return self._result(args, result)
        raise AssertionError("unreachable")

    async def _forget(self, conn: asyncssh.SSHClientConnection) -> None:
        if self._conn is conn:
            self._conn = None
        conn.close()

    def _result(self, args: tuple[str, ...], result: asyncssh.SSHCompletedProcess) -> str:
        stdout = _text(result.stdout)
        stderr = _text(result.stderr)
        if result.exit_status is None or result.exit_status < 0:
            signal = result.exit_signal[0] if result.exit_signal else "unknown"
            raise SshError(f"{shlex.join(args)} was killed on {self.target} (signal {signal}): {stderr.strip()}")
        code = int(result.exit_status)
        if code in _NOT_RUN_CODES and not stdout:
            raise SshError(
                f"{shlex.join(args)} could not be run on {self.target} (exit {code}): {stderr.strip() or '(no output)'}",
                argv=args,
                returncode=code,
                stderr=stderr,
            )
        if code != 0:
            # Same contract as slurmio's LocalRunner: exit code and stderr ride along.
            raise SlurmCommandError.exited(args, code, stdout, stderr, where=f" on {self.target}")
        return stdout


class SlurmSshBackend(SlurmCliBackend):
    """SlurmCliBackend whose commands run on a login node through an ``SshRunner``."""

    name = "slurm-ssh"

    def __init__(self, runner: SshRunner, *, timeout: float = 30.0) -> None:
        super().__init__(runner, timeout=timeout)
        self.runner = runner

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> SlurmSshBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def slurm_ssh_backend(
    host: str,
    port: int,
    user: str,
    key_path: str | os.PathLike[str],
    known_hosts: str | os.PathLike[str],
    slurm_conf: str | None = None,
    *,
    passphrase: str | None = None,
    timeout: float = 30.0,
    connect_timeout: float = 10.0,
    keepalive_interval: float = 30.0,
    slurm_bin_dir: str | None = None,
) -> SlurmSshBackend:
    """The Slurm backend for ``--slurm-access ssh``: scontrol & co. on ``user@host:port``.

    ``slurm_conf`` is the path of slurm.conf on the remote host, passed as
    SLURM_CONF only when given. ``timeout`` bounds each command. Nothing
    connects until the first call (or ``backend.runner.connect()``).
    """
    runner = SshRunner(
        host,
        port,
        user,
        key_path,
        known_hosts,
        slurm_conf=slurm_conf,
        passphrase=passphrase,
        connect_timeout=connect_timeout,
        keepalive_interval=keepalive_interval,
        slurm_bin_dir=slurm_bin_dir,
    )
    return SlurmSshBackend(runner, timeout=timeout)


# ---------------------------------------------------------------------- helpers
def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def _check_remote_path(what: str, value: str) -> None:
    if not isinstance(value, str) or not value.startswith("/") or _CONTROL_RE.search(value):
        raise ValueError(f"invalid {what} {value!r}: must be an absolute path without control characters")


def _load_private_key(path: str, passphrase: str | None) -> asyncssh.SSHKey:
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as exc:
        raise ValueError(f"SSH private key {path}: {exc.strerror}") from None
    if stat.S_IMODE(mode) & 0o077:
        # OpenSSH refuses such keys; we only warn because mounted secrets are often 0644.
        log.warning("SSH private key %s is readable by group/others (mode %o)", path, stat.S_IMODE(mode))
    try:
        return asyncssh.read_private_key(path, passphrase)
    except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError, OSError, ValueError) as exc:
        # The library's messages name the problem, never the key or passphrase.
        raise ValueError(f"cannot load SSH private key {path}: {type(exc).__name__}: {_reason(exc)}") from None


def _check_known_hosts(path: str) -> None:
    try:
        asyncssh.read_known_hosts(path)
    except OSError as exc:
        raise ValueError(f"known_hosts file {path}: {exc.strerror}") from None
    except (ValueError, asyncssh.KeyImportError) as exc:
        raise ValueError(f"known_hosts file {path} cannot be parsed: {exc}") from None


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", "") or exc or type(exc).__name__)


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)
