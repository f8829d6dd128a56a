"""docs/deploy-bare-metal.md's credential steps, followed as written.

The guide's `# guide: credentials, ...` shell blocks run in scratch roots (one for the central
host, one for a GPU node: every absolute path of the block moved under the root, `systemctl`
a stub), with this checkout's `trainmedic` and the real openssl, install and sed. Then every
`LoadCredential=` of every unit of that host, with the drop-ins the block installed, must name
a file that now exists, and each unit's Kafka user must be its principal of the ACL matrix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bus import acls
from bus.identity import node_key
from tests.integration import test_systemd_units as units

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "deploy-bare-metal.md"
# Made elsewhere in the guide: its content is the site's webhooks ("Webhook notifications").
NOT_A_SECRET = {"/etc/trainmedic/notifier.yaml"}

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the guide's steps use openssl")


def guide_block(title: str) -> str:
    blocks = re.findall(r"```sh\n(# guide: [^\n]*\n.*?)```", GUIDE.read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith(f"# guide: {title}\n")]
    return block


def follow(block: str, root: Path, env: dict[str, str]) -> None:
    """Run a guide block as root would on a host whose / is `root`."""
    moved = re.sub(r"(?<![\w.$/-])/(etc|root)/", lambda m: f"{root}/{m.group(1)}/", block)
    stubs = root / "stub-bin"
    stubs.mkdir(parents=True, exist_ok=True)
    (stubs / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {root}/systemctl.log\n')
    (stubs / "systemctl").chmod(0o755)
    # The host's config.yaml holds no secret; here only the cluster's name, the guide's default.
    config = root / "config.yaml"
    config.write_text("cluster: default\n")
    path = f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    run_env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "TRAINMEDIC_CONFIG": str(config), **env}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", moved], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, f"the guide's block failed:\n{moved}\n{proc.stderr}"


def credentials_of(unit: str, root: Path) -> dict[str, str]:
    """LoadCredential= name -> source path of `unit` with the drop-ins installed under `root`."""
    parsed = units.parse_unit(units.unit_path(unit))
    dropins = sorted((root / "etc/systemd/system" / f"trainmedic-{unit}.service.d").glob("*.conf"))
    merged = parsed.merged(*(units.parse_unit(d) for d in dropins))
    out = {}
    for value in merged.values("Service", "LoadCredential"):
        name, source = value.split(":", 1)
        out[name] = source.replace("%N", f"trainmedic-{unit}")
    return out


def kafka_user(unit: str, root: Path) -> str | None:
    dropins = sorted((root / "etc/systemd/system" / f"trainmedic-{unit}.service.d").glob("*.conf"))
    merged = units.parse_unit(units.unit_path(unit)).merged(*(units.parse_unit(d) for d in dropins))
    for value in merged.values("Service", "Environment"):
        if value.startswith("TRAINMEDIC_KAFKA_SASL_USERNAME="):
            return value.split("=", 1)[1].replace("%N", f"trainmedic-{unit}")
    return None


def test_the_guides_steps_make_every_credential_file_the_units_read(tmp_path: Path) -> None:
    central, node = tmp_path / "central", tmp_path / "gpu001"
    follow(guide_block("credentials, central host"), central, {})
    # The node's directory goes to it from the central host, as the guide says.
    shutil.copytree(central / "root/trainmedic-nodes/gpu001", node / "root/trainmedic-nodes/gpu001")
    follow(guide_block("credentials, GPU node"), node, {"NODE": "gpu001"})

    for host, root, names in (
        ("central", central, (*units.CENTRAL, *units.ONE_SHOTS)),
        ("node", node, units.NODE),
    ):
        for unit in names:
            creds = credentials_of(unit, root)
            missing = [
                f"{n}:{src}" for n, src in creds.items() if src not in NOT_A_SECRET and not (root / src[1:]).is_file()
            ]
            assert not missing, f"{host} trainmedic-{unit}: the guide makes no {missing}"
            for src in creds.values():
                if src not in NOT_A_SECRET:
                    assert (root / src[1:]).stat().st_mode & 0o077 == 0, f"{src} is readable by others"
            user = kafka_user(unit, root)
            component = {"dcgm": "gpu", "audit-migrate": None}.get(unit, unit)
            if component is None:
                assert user is None, "the migration has no Kafka principal"
            else:
                assert f"User:{user}" == acls.principal(acls.DEFAULT_PRINCIPAL, component), unit

    # A unit that needs Kafka SASL gets it; the node holds its own key and not the site secret.
    assert "kafka-sasl-password" in credentials_of("streams", central)
    assert "site-secret" in credentials_of("streams", central) and "site-secret" in credentials_of("ingest", central)
    assert not (node / "etc/trainmedic/credentials/site-secret").exists()
    assert not (node / "root/trainmedic-nodes").exists() or not any((node / "root/trainmedic-nodes").iterdir())
    secret = (central / "etc/trainmedic/credentials/site-secret").read_text().strip().encode()
    key = (node / "etc/trainmedic/node-key").read_text().strip()
    assert key == node_key(secret, "default", "gpu001").hex()
    assert "daemon-reload" in (node / "systemctl.log").read_text()


def test_the_check_fails_when_the_guide_skips_a_file(tmp_path: Path) -> None:
    block = guide_block("credentials, central host").replace('openssl rand -hex 32 > "$C/token"\n', "")
    follow(block, tmp_path, {})
    creds = credentials_of("api", tmp_path)
    assert not (tmp_path / creds["token"][1:]).exists()
