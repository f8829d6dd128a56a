"""`trainmedic ingest ...`: the credentials of the ingest endpoint (docs/ingest.md, "Identity").

`trainmedic ingest job-token JOBID` prints the job's ingest token for a Slurm prolog to hand to
the job; `trainmedic ingest node-key NODE` prints a node's signing key for its producers; `ingest_auth()` builds the ingest server's credential policy from the settings.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from schemas.errors import UsageError
from trainmedic.cli.base import new_app, settings

if TYPE_CHECKING:
    from producers.ingest_auth import IngestAuth
    from trainmedic.settings import Settings

ingest_app = new_app(help="Credentials of the ingest endpoint (NVSentinel, NVRx).")
log = logging.getLogger("trainmedic.cli.ingest")


@ingest_app.command("job-token")
def job_token_cmd(
    job_id: Annotated[str, typer.Argument(help="The Slurm job id ($SLURM_JOB_ID in a prolog).")],
    cluster: Annotated[Optional[str], typer.Option(help="Cluster name (default: the setting cluster).")] = None,
) -> None:
    """Print the job's ingest token (`job:JOB_ID:HMAC`), derived from the setting site_secret.

    Run it in a Slurm prolog (as root, which can read the site secret) and hand the output to the
    job only, e.g. in a file of mode 0400 owned by the job's user. It lets the job report about
    itself and no other job."""
    from bus.identity import check_site_secret, job_token

    s = settings(cluster=cluster)
    secret = s.secret("site_secret")
    if not secret:
        raise UsageError("no site secret: set TRAINMEDIC_SITE_SECRET(_FILE) or site_secret in the config file")
    if not _job_id_ok(job_id):
        raise UsageError(f"not a Slurm job id: {job_id[:40]!r}")
    try:
        key = check_site_secret(secret)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    typer.echo(job_token(key, s.cluster, job_id))


@ingest_app.command("node-key")
def node_key_cmd(
    node: Annotated[str, typer.Argument(help="The Slurm node name whose producers are to sign with the key.")],
    cluster: Annotated[Optional[str], typer.Option(help="Cluster name (default: the setting cluster).")] = None,
) -> None:
    """Print the node's signing key (64 hex), derived from the setting site_secret.

    Install it on that node only, root-only (e.g. /etc/trainmedic/node-key, mode 0600) and point
    the node producers at it (TRAINMEDIC_NODE_KEY_FILE or node_key_file): they sign every GPU,
    kernel and port record with it, and the streams worker (which holds site_secret) refuses a
    signed record that names another node. The node never holds the site secret."""
    from bus.identity import check_site_secret, node_key
    from schemas.ids import check_node_name

    s = settings(cluster=cluster)
    secret = s.secret("site_secret")
    if not secret:
        raise UsageError("no site secret: set TRAINMEDIC_SITE_SECRET(_FILE) or site_secret in the config file")
    name = check_node_name(node)  # NodeNameError is a UsageError
    try:
        key = check_site_secret(secret)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    typer.echo(node_key(key, s.cluster, name).hex())


def _job_id_ok(job_id: str) -> bool:
    """The job id forms an NVRx report may name (`1234`, `1234_7`, `1234+0`)."""
    from producers.ingest import JOB_ID_RE

    return JOB_ID_RE.fullmatch(job_id) is not None


def ingest_auth(s: Settings, token_file: Path | None = None) -> IngestAuth:
    """The ingest server's credentials as the settings have them; ValueError naming what is wrong."""
    from producers.ingest import TOKEN_ENV, load_token
    from producers.ingest_auth import IngestAuth, MungeVerifier, SlurmJobOwners
    from slurmio.runners import LocalRunner

    shared = None
    if token_file is not None or s.secret("ingest_token"):
        # The shared token as the settings have it (TRAINMEDIC_INGEST_TOKEN, _FILE or the config file).
        shared = load_token(token_file, {TOKEN_ENV: s.secret("ingest_token") or ""})
    munge = owners = None
    if s.ingest_munge:
        if shutil.which("unmunge") is None:
            log.warning("ingest: unmunge is not installed: MUNGE credentials are refused (setting ingest_munge)")
        else:
            munge, owners = MungeVerifier(s.ingest_munge_socket), SlurmJobOwners(LocalRunner())
    return IngestAuth(
        shared_token=shared,
        service_token=s.secret("ingest_service_token"),
        site_secret=s.secret("site_secret"),
        cluster=s.cluster,
        allow_shared_token_for_jobs=s.ingest_allow_shared_token_for_jobs,
        munge=munge,
        job_owner=owners,
    )
