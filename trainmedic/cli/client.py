"""How the CLI talks to a running `trainmedic up`: its operator API, found through
DATA_DIR/runtime.json, authenticated with the token in DATA_DIR/api-token. An https API's
certificate is verified against the ca_bundle setting, else the system's trust store."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from schemas.errors import ConfigError, Refused, TrainmedicError, Unavailable
from schemas.masking import remember


class ClientError(TrainmedicError, RuntimeError):
    """A call to the operator API failed; the subclass says how (and so the CLI's exit status)."""


class ApiUnreachable(ClientError, Unavailable):
    """No `trainmedic up` is running there, it does not answer, or it failed (5xx)."""


class ApiRefused(ClientError, Refused):
    """The API answered 4xx: unknown id, bad token, already decided, not ready for autonomy..."""


class ClientConfigError(ClientError, ConfigError):
    """No token, or the running `trainmedic up` serves no API."""


def api_url(data_dir: Path, explicit: str | None) -> str:
    if explicit:
        return explicit.rstrip("/")
    runtime = data_dir / "runtime.json"
    try:
        info = json.loads(runtime.read_text())
    except (OSError, ValueError):
        raise ApiUnreachable(
            f"trainmedic up is not running with data dir {data_dir} ({runtime} missing); start it, or pass --api URL"
        ) from None
    if not info.get("api_url"):
        raise ClientConfigError(f"the running trainmedic up ({runtime}) serves no operator API")
    return str(info["api_url"])


def api_token(data_dir: Path, explicit: str | None) -> str:
    if explicit:  # the settings' token (trainmedic.settings: env, *_FILE or config file)
        return explicit
    try:
        token = (data_dir / "api-token").read_text().strip()
    except OSError:
        raise ClientConfigError(
            f"no token: set TRAINMEDIC_TOKEN or TRAINMEDIC_TOKEN_FILE, or make {data_dir / 'api-token'} readable"
        ) from None
    remember(token)  # masked in whatever this process prints (schemas/masking.py)
    return token


def tls_context(ca_bundle: Path | None) -> ssl.SSLContext:
    """Verification of the API's certificate: the bundle's CAs when one is given, else the system's."""
    try:
        return ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise ClientConfigError(f"ca_bundle {ca_bundle}: not a readable PEM CA bundle ({exc})") from None


def _configured_ca_bundle() -> Path | None:
    # Imported here: base imports this module lazily, and the settings are the command's (its --config).
    from trainmedic.cli.base import settings

    return settings().ca_bundle


def call(
    url: str,
    token: str,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    ca_bundle: Path | None = None,
) -> Any:
    """One API request; `ca_bundle` None: the ca_bundle setting (TRAINMEDIC_CA_BUNDLE, config file)."""
    context = tls_context(ca_bundle or _configured_ca_bundle()) if url.startswith("https:") else None
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail")
        except ValueError:
            detail = exc.reason
        error = ApiRefused if exc.code < 500 else ApiUnreachable
        raise error(f"{method} {path}: {exc.code} {detail}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise ClientConfigError(
                f"cannot verify the TLS certificate of the trainmedic API at {url} ({exc.reason.verify_message}): "
                "set ca_bundle (TRAINMEDIC_CA_BUNDLE) to the CA bundle that signed it"
            ) from None
        raise ApiUnreachable(f"cannot reach the trainmedic API at {url}: {exc.reason}") from None
