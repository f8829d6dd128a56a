"""One way to run a Slurm command: ``runner(argv, timeout) -> stdout``.

A runner runs one argv (never through a shell) and returns its stdout. Any
failure - the command could not be started, timed out, was cut off, or exited
non-zero - raises `SlurmCommandError`, whose message names the command; the
exit code, stdout and stderr ride along for callers that must tell failures
apart (``scontrol`` says ``Invalid job id specified`` for a purged job).

`LocalRunner` runs the commands here. The SSH runner of the executor
(sinks/backends/slurm_ssh.SshRunner) runs them on a login node and keeps the
same contract, so the producers and the backends take either.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import Protocol

from schemas.errors import Unavailable

__all__ = ["LocalRunner", "Runner", "SlurmCommandError"]

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SlurmCommandError(Unavailable, RuntimeError):
    """A Slurm command could not be run, timed out or exited non-zero; the message names it."""

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message)
        self.argv = tuple(argv)
        self.returncode = returncode  # None: it never ran to an exit status
        self.stdout = stdout
        self.stderr = stderr

    @classmethod
    def exited(
        cls, argv: Sequence[str], returncode: int, stdout: str, stderr: str, where: str = ""
    ) -> SlurmCommandError:
        err = (stderr or stdout).strip()[:500] or "(no output)"
        return cls(
            f"{shlex.join(argv)}{where} exited {returncode}: {err}",
            argv=argv,
            returncode=returncode,
            stdout=stdout,
            stderr=stderr,
        )


class Runner(Protocol):
    """Runs one argv (never through a shell) and returns its stdout; raises SlurmCommandError."""

    def __call__(self, argv: Sequence[str], timeout: float) -> str: ...


class LocalRunner:
    """Runs Slurm commands on this machine with an explicit, minimal environment.

    The child gets PATH, LC_ALL=C, HOME and SLURM_CONF only: stray SLURM_*
    variables of the caller (SLURM_JOB_ID inside an allocation, SQUEUE_FORMAT,
    ...) must not change what the commands print. ``path`` replaces PATH, e.g.
    to put the 24.11 wrappers of infra/slurm/start-2411.sh first.
    """

    def __init__(
        self,
        slurm_conf: str | None = None,
        *,
        path: str | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        env: dict[str, str] = {
            "PATH": path or os.environ.get("PATH") or _DEFAULT_PATH,
            "LC_ALL": "C",
            "HOME": os.environ.get("HOME", "/"),
        }
        conf = slurm_conf if slurm_conf is not None else os.environ.get("SLURM_CONF")
        if conf:
            env["SLURM_CONF"] = conf
        if extra_env:
            env.update(extra_env)
        self.env: Mapping[str, str] = env

    def __repr__(self) -> str:
        return f"LocalRunner(SLURM_CONF={self.env.get('SLURM_CONF')!r})"

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        args = [str(a) for a in argv]
        try:
            proc = subprocess.run(
                args,
                shell=False,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=dict(self.env),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise SlurmCommandError(f"{shlex.join(args)} timed out after {timeout:g}s", argv=args) from exc
        except OSError as exc:
            raise SlurmCommandError(f"{shlex.join(args)} could not be run: {exc}", argv=args) from exc
        if proc.returncode != 0:
            raise SlurmCommandError.exited(args, proc.returncode, proc.stdout, proc.stderr)
        return proc.stdout
