"""Which scheduler backend a command acts through: the `--backend` and Slurm access flags over
the settings (slurm_access and the slurm_ssh_* / slurmrestd_* fields)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from schemas.errors import ConfigError, UsageError
from trainmedic.cli.base import config_file, settings
from trainmedic.settings import secret_file

SshOpt = Annotated[Optional[str], typer.Option("--ssh", help="slurm-ssh: USER@HOST[:PORT] of a login node.")]
SshKeyOpt = Annotated[Optional[Path], typer.Option("--ssh-key", help="slurm-ssh: private key file.")]
KnownHostsOpt = Annotated[Optional[Path], typer.Option("--known-hosts", help="slurm-ssh: known_hosts file (strict).")]
RemoteConfOpt = Annotated[Optional[str], typer.Option("--remote-slurm-conf", help="slurm-ssh: SLURM_CONF there.")]
RestUrlOpt = Annotated[Optional[str], typer.Option("--rest-url", help="slurm-rest: slurmrestd URL, https://HOST:PORT.")]
RestUserOpt = Annotated[Optional[str], typer.Option("--rest-user", help="slurm-rest: the Slurm user of the token.")]
RestTokenFileOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--rest-token-file", help="slurm-rest: file holding the JWT (default: env TRAINMEDIC_SLURMRESTD_TOKEN)."
    ),
]


# The settings' Slurm access -> the backend that provides it.
_ACCESS_BACKEND = {"local": "slurm-cli", "ssh": "slurm-ssh", "rest": "slurm-rest"}


def scheduler_backend(
    name: str | None,
    ssh: str | None = None,
    ssh_key: Path | None = None,
    known_hosts: Path | None = None,
    remote_slurm_conf: str | None = None,
    rest: tuple[str | None, str | None, Path | None] = (None, None, None),
) -> Any:
    """The scheduler backend: slurm-cli runs Slurm's CLI here (munge auth); slurm-ssh runs it on a
    login node over SSH with strict host-key checking; slurm-rest calls slurmrestd with a JWT
    (what its API cannot do is refused, see sinks/backends/slurm_rest_api.yaml); pyslurm calls libslurm in-process (Slurm
    23.02+, untested here); simulated is the demo's in-memory scheduler.

    Flags override the settings (TRAINMEDIC_SLURM_ACCESS, TRAINMEDIC_SLURM_SSH_*, TRAINMEDIC_SLURMRESTD_*,
    or the config file); without --backend the settings' slurm_access chooses."""
    flags: dict[str, Any] = {
        "slurm_ssh_key": ssh_key,
        "slurm_ssh_known_hosts": known_hosts,
        "slurm_ssh_slurm_conf": remote_slurm_conf,
        "slurmrestd_url": rest[0],
        "slurmrestd_user": rest[1],
    }
    if ssh:
        user, _, hostport = ssh.rpartition("@")
        host, _, port = hostport.partition(":")
        if not user or not host or (port and not port.isdigit()):
            raise UsageError(f"--ssh {ssh!r}: expected USER@HOST[:PORT]")
        flags |= {"slurm_ssh_user": user, "slurm_ssh_host": host, "slurm_ssh_port": int(port) if port else None}
    s = settings(**flags)
    name = name or _ACCESS_BACKEND[s.slurm_access]
    if name == "slurm-cli":
        from sinks.backends.slurm_cli import SlurmCliBackend

        return SlurmCliBackend()
    if name == "slurm-ssh":
        from sinks.backends.slurm_ssh import slurm_ssh_backend

        if not (s.slurm_ssh_host and s.slurm_ssh_user and s.slurm_ssh_key and s.slurm_ssh_known_hosts):
            raise UsageError(
                "slurm-ssh needs a login node, a key and known hosts: --ssh USER@HOST[:PORT], --ssh-key FILE and "
                "--known-hosts FILE (or TRAINMEDIC_SLURM_SSH_HOST, _USER, _KEY, _KNOWN_HOSTS)"
            )
        try:
            return slurm_ssh_backend(
                s.slurm_ssh_host,
                s.slurm_ssh_port,
                s.slurm_ssh_user,
                s.slurm_ssh_key,
                s.slurm_ssh_known_hosts,
                slurm_conf=s.slurm_ssh_slurm_conf,
                passphrase=s.secret("slurm_ssh_passphrase"),
            )
        except (ValueError, OSError) as exc:
            raise ConfigError(
                f"--ssh-key/--known-hosts (or TRAINMEDIC_SLURM_SSH_KEY, _KNOWN_HOSTS, _PASSPHRASE): {exc}"
            ) from None
    if name == "slurm-rest":
        from sinks.backends.base import BackendError
        from sinks.backends.slurm_rest import SlurmRestBackend, TokenSource

        if not s.slurmrestd_url or not s.slurmrestd_user:
            raise UsageError(
                "slurm-rest needs --rest-url URL and --rest-user USER (or TRAINMEDIC_SLURMRESTD_URL, _USER); "
                "the token: --rest-token-file FILE, TRAINMEDIC_SLURMRESTD_TOKEN_FILE or TRAINMEDIC_SLURMRESTD_TOKEN"
            )
        token_file = rest[2] or secret_file("slurmrestd_token", config_file())
        if token_file is not None:
            token = TokenSource(file=token_file)
        elif (value := s.secret("slurmrestd_token")) is not None:
            token = TokenSource(value=value)
        else:
            raise UsageError("slurm-rest: no token (--rest-token-file, TRAINMEDIC_SLURMRESTD_TOKEN[_FILE])")
        try:
            return SlurmRestBackend(s.slurmrestd_url, s.slurmrestd_user, token)
        except (BackendError, ValueError) as exc:
            raise ConfigError(f"--backend slurm-rest: {exc}") from None
    if name == "simulated":
        from sinks.backends.simulated import SimulatedScheduler

        return SimulatedScheduler([])
    if name == "pyslurm":
        from sinks.backends.base import BackendError
        from sinks.backends.pyslurm_backend import PyslurmBackend

        try:
            return PyslurmBackend()
        except BackendError as exc:
            raise ConfigError(f"--backend pyslurm: {exc}") from None
    raise UsageError(f"--backend {name!r}: expected slurm-cli, slurm-ssh, slurm-rest, pyslurm or simulated")
