"""The bare-metal systemd units (infra/systemd) checked two ways, as the chart test does for Helm.

1. `systemd-analyze verify` on a copy of every unit, target and drop-in whose ExecStart binary
   is rewritten to this checkout's venv (verify insists it exists). Strict: any line verify
   prints (an unknown directive, a missing unit) fails, not only its exit status - a typo'd
   directive is merely a warning to systemd; the negative cases prove the check catches them.
   `systemd-analyze security --offline` keeps every unit's exposure level low.
2. Each unit's ExecStart started as systemd would start it: its Environment= (specifiers %d
   and %S materialised under tmp_path), EnvironmentFile= (the example .env plus a site's
   overrides), LoadCredential= files, StateDirectory= and WorkingDirectory=, a clean
   environment; /opt/trainmedic/bin/trainmedic rewritten to this venv's. The bootstrap comes
   from the config file (the broker fixture), the ClickHouse URL from its credential (a chDB
   folder, one process at a time), each probe port is free. Long-running commands must answer
   /readyz 200 and exit 0 on SIGTERM (tests/launch.py); one-shots must exit 0. ExecStartPre=
   runs first, with the unit's UMask=, in its RuntimeDirectory= (%t materialised too).
   Credentials are written as systemd writes them: 0400, and, where its credentials file system
   takes ACLs (tmpfs noswap: systemd 255+ on Linux 6.4+), readable by the service's user through
   an ACL, which makes them show as 0440 (Site.credential_acl). The notifier is started with a
   webhooks YAML and a token credential, and must deliver an incident to a local receiver.

Not tested here (PID 1 is not systemd on these machines): systemd itself - dependency
ordering and Requires= failure propagation, LoadCredential= as systemd does it, the sandbox
(DynamicUser, ProtectSystem=strict, SystemCallFilter, SupplementaryGroups), restarts and start
limits really happening, KillMode. `produce gpu` has no GPU here (it must fail saying NVML);
the Slurm producer and the job log producer need the local Slurm cluster (mark `slurm`).
"""

from __future__ import annotations

import http.server
import os
import re
import shlex
import shutil
import ssl
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from bus.publish import Publisher
from schemas.events import Evidence, Incident
from schemas.topics import ALL_TOPICS, INCIDENTS
from sinks.notifier import NotifierConfigError, read_token
from tests.conftest import FIXTURES, REPO, Cluster, read_topic, wait_for
from tests.launch import Launched, self_signed_certificate, start, stop, wait_ready
from trainmedic.settings import Settings, secret_fields, unknown_env
from trainmedic.stack.broker import EmbeddedBroker, free_port

UNITS = REPO / "infra" / "systemd"
DROPINS = UNITS / "dropins"
INSTALLED = "/opt/trainmedic/bin/trainmedic"
TRAINMEDIC = str(Path(sys.executable).with_name("trainmedic"))
ANALYZE = shutil.which("systemd-analyze")
# The PATH systemd gives a service.
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Variables the units' command lines use that are not settings (documented in the units).
UNIT_VARIABLES = {"KERNEL_SOURCE", "DCGM_URL", "INGEST_HOST", "INGEST_PORT", "INGEST_TLS", "LOGS_ARGS"} | {
    "RESET_COMMAND",
    "RESET_ALL_COMMAND",
    "NODE_AGENT_ARGS",
}
OTHER_VARIABLES = {"SLURM_CONF", "PYTHONUNBUFFERED"}
CENTRAL = ("streams", "executor", "audit-sink", "api", "ingest", "notifier", "slurm-producer")
NODE = ("gpu", "dcgm", "ib", "kernel", "logs", "node-agent")
# Units that run as root, each with the one capability it needs as its whole bounding set.
ROOT = {"trainmedic-node-agent.service": "CAP_SYS_ADMIN"}
ONE_SHOTS = ("topics", "audit-migrate")
# Settings a bare-metal site does not set, and why.
NOT_FOR_SITES = {"clickhouse_password": "dropins/clickhouse-password.conf names it by its _FILE form"}

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="needs systemd-analyze (package systemd)")


# -- systemd's unit file format: sections, repeated keys, comments, line continuations ----------


@dataclass
class UnitFile:
    name: str
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def values(self, section: str, key: str) -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def value(self, section: str, key: str) -> str | None:
        found = self.values(section, key)
        return found[-1] if found else None

    def merged(self, *dropins: UnitFile) -> UnitFile:
        """This unit with drop-ins applied: their assignments come after the unit's."""
        out = UnitFile(self.name, {s: list(kv) for s, kv in self.sections.items()})
        for d in dropins:
            for s, kv in d.sections.items():
                out.sections.setdefault(s, []).extend(kv)
        return out


def parse_unit(path: Path) -> UnitFile:
    return parse_unit_text(path.name, path.read_text())


def parse_unit_text(name: str, text: str) -> UnitFile:
    unit = UnitFile(name)
    section: str | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            unit.sections.setdefault(section, [])
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"{name}: not a key=value line in a section: {raw!r}"
        unit.sections[section].append((key.strip(), value.strip()))
    return unit


def unit_path(short: str) -> Path:
    suffix = ".target" if short in ("central", "node") else ".service"
    return UNITS / f"trainmedic-{short}{suffix}"


def all_units() -> list[Path]:
    return sorted([*UNITS.glob("trainmedic-*.service"), *UNITS.glob("trainmedic-*.target")])


def dropin_targets(path: Path) -> list[str]:
    """Where a drop-in goes: its `# install: DIR.d/NAME.conf` lines."""
    return re.findall(r"^# install: (\S+)$", path.read_text(), flags=re.M)


# -- systemd-analyze ----------------------------------------------------------------------------


def installed_copy(dest: Path, dropins: dict[str, str] | None = None) -> Path:
    """The units (and drop-ins: `DIR.d/NAME.conf` -> source text) in `dest` as verify sees them."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in all_units():
        (dest / path.name).write_text(path.read_text().replace(INSTALLED, TRAINMEDIC))
    for where, text in (dropins or {}).items():
        (dest / where).parent.mkdir(parents=True, exist_ok=True)
        (dest / where).write_text(text)
    return dest


def analyze_verify(folder: Path, names: list[str]) -> list[str]:
    """What verify objects to: its output lines (warnings included), and a non-zero status."""
    assert ANALYZE is not None
    proc = subprocess.run(
        [ANALYZE, "verify", "--man=no", *(str(folder / n) for n in names)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": SYSTEMD_PATH, "SYSTEMD_LOG_COLOR": "0", "LANG": "C.UTF-8"},
    )
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if proc.returncode != 0:
        problems.append(f"systemd-analyze verify exited {proc.returncode}")
    return problems


@needs_analyze
def test_every_unit_and_target_passes_verify_strictly(tmp_path: Path) -> None:
    folder = installed_copy(tmp_path / "units")
    names = [p.name for p in all_units()]
    assert {f"trainmedic-{s}.service" for s in (*CENTRAL, *NODE, *ONE_SHOTS)} <= set(names)
    assert analyze_verify(folder, names) == []


@needs_analyze
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("ProtectSystem=strict", "ProtectSytem=strict"), "Unknown key 'ProtectSytem'"),
        (("Requires=trainmedic-topics.service", "Requires=trainmedic-topic.service"), "trainmedic-topic.service"),
        (("[Service]", "[Servce]"), "Unknown section 'Servce'"),
        ((TRAINMEDIC, INSTALLED), "is not executable"),
    ],
    ids=["typo-directive", "missing-unit", "typo-section", "no-binary"],
)
def test_verify_check_fails_on_a_broken_unit(tmp_path: Path, change: tuple[str, str], expected: str) -> None:
    folder = installed_copy(tmp_path / "units")
    unit = folder / "trainmedic-streams.service"
    text = unit.read_text()
    assert change[0] in text
    unit.write_text(text.replace(change[0], change[1], 1))
    problems = analyze_verify(folder, [unit.name])
    assert any(expected in p for p in problems), problems


@needs_analyze
def test_every_dropin_installs_where_it_says_and_verifies(tmp_path: Path) -> None:
    dropins = sorted(DROPINS.glob("*.conf"))
    assert dropins
    for path in dropins:
        targets = dropin_targets(path)
        assert targets, f"{path.name}: no '# install: UNIT.d/NAME.conf' line"
        folder = installed_copy(tmp_path / path.stem, {t: path.read_text() for t in targets})
        units = set()
        for target in targets:
            unit = target.split(".d/")[0]
            # A prefix drop-in (trainmedic-.service.d) applies to every trainmedic-*.service.
            units |= {
                p.name for p in all_units() if p.name == unit or (unit.endswith("-.service") and p.suffix == ".service")
            }
        assert units, f"{path.name}: {targets} name no unit"
        assert analyze_verify(folder, sorted(units)) == [], path.name
    # The check sees into drop-ins: a typo in one fails it.
    folder = installed_copy(tmp_path / "typo", {"trainmedic-api.service.d/x.conf": "[Service]\nEnviroment=A=1\n"})
    assert any("Unknown key 'Enviroment'" in p for p in analyze_verify(folder, ["trainmedic-api.service"]))


@needs_analyze
def test_every_service_keeps_a_low_exposure_level(tmp_path: Path) -> None:
    folder = installed_copy(tmp_path / "units")
    assert ANALYZE is not None

    def exposed(name: str) -> subprocess.CompletedProcess[str]:
        # --threshold is in tenths: 30 = exposure 3.0 of 10 ("OK" in systemd's words is below 5).
        return subprocess.run(
            [ANALYZE, "security", "--offline=yes", "--threshold=30", "--no-pager", str(folder / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    for path in UNITS.glob("trainmedic-*.service"):
        proc = exposed(path.name)
        assert proc.returncode == 0, f"{path.name}: {proc.stdout.splitlines()[-1:]}"
    bare = folder / "trainmedic-bare.service"
    bare.write_text(f"[Service]\nExecStart={TRAINMEDIC} run streams\n")
    assert exposed(bare.name).returncode != 0  # the threshold does catch an unhardened unit


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="needs systemd-sysusers")
def test_the_sysusers_file_makes_the_named_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    conf = UNITS / "sysusers.d" / "trainmedic.conf"
    proc = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^trainmedic:x:\d+:\d+:", (tmp_path / "etc" / "passwd").read_text(), flags=re.M)
    named = {u.name for u in map(parse_unit, UNITS.glob("*.service")) if u.value("Service", "User") == "trainmedic"}
    assert named and all(
        u.value("Service", "DynamicUser") == "yes"
        for u in map(parse_unit, UNITS.glob("*.service"))
        if u.name not in named and u.name not in ROOT
    )
    for name, capability in ROOT.items():
        unit = parse_unit(UNITS / name)
        assert unit.value("Service", "User") is None and unit.value("Service", "DynamicUser") is None
        assert unit.value("Service", "CapabilityBoundingSet") == capability, name
        assert unit.value("Service", "AmbientCapabilities") == capability, name


# -- what the units name exists --------------------------------------------------------------


def _env_assignments(unit: UnitFile) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in unit.values("Service", "Environment"):
        for word in shlex.split(value):
            name, sep, val = word.partition("=")
            assert sep, f"{unit.name}: Environment={value!r} is not NAME=value"
            out[name] = val
    return out


def _env_file_names(path: Path) -> list[str]:
    return re.findall(r"^#?([A-Z][A-Z0-9_]*)=", path.read_text(), flags=re.M)


def test_every_variable_the_units_set_is_a_setting_or_a_command_line_variable() -> None:
    names: set[str] = set()
    for path in [*all_units(), *DROPINS.glob("*.conf")]:
        unit = parse_unit(path)
        env = _env_assignments(unit)
        names |= set(env)
        loaded = {c.split(":", 1)[0] for c in unit.values("Service", "LoadCredential")}
        for name, value in env.items():
            for cred in re.findall(r"%d/([\w.-]+)", value):
                assert cred in loaded, f"{path.name}: {name} reads credential {cred} that it does not load"
            setting = name.removeprefix("TRAINMEDIC_").lower()
            if name.startswith("TRAINMEDIC_") and name.endswith("_FILE") and setting not in Settings.model_fields:
                field_name = setting.removesuffix("_file")
                assert field_name in secret_fields(), f"{path.name}: {name}: {field_name} is not a secret setting"
        for ref in re.findall(r"\$\{?(\w+)", unit.value("Service", "ExecStart") or ""):
            assert ref in UNIT_VARIABLES and ref in env, f"{path.name}: ExecStart uses ${ref} without a default"
    examples = sorted((UNITS / "env").glob("*.env.example"))
    for path in examples:
        names |= set(_env_file_names(path))
        owner = unit_path(path.name.removesuffix(".env.example"))
        assert owner.is_file(), f"{path.name}: no unit {owner.name}"
        assert f"/etc/trainmedic/{path.name.removesuffix('.example')}" in owner.read_text()
    settings_env = {n: "x" for n in names if n.startswith("TRAINMEDIC_")}
    assert unknown_env(settings_env) == []
    assert names - set(settings_env) <= UNIT_VARIABLES | OTHER_VARIABLES
    # Every service has its example .env.
    assert {p.name.removesuffix(".env.example") for p in examples} == {*CENTRAL, *NODE, *ONE_SHOTS}


def _example_config(dest: Path) -> Path:
    text = (UNITS / "config.yaml.example").read_text()
    settings = [line[1:] for line in text.splitlines() if re.match(r"^#[a-z_]+: ", line)]
    dest.write_text("\n".join(settings) + "\n")
    return dest


def test_the_example_config_sets_real_settings_and_covers_what_a_site_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("TRAINMEDIC_"):
            monkeypatch.delenv(name)
    config = _example_config(tmp_path / "config.yaml")
    loaded = Settings.load(config)  # every value valid; an unknown key is refused
    keys = {line.split(":", 1)[0] for line in config.read_text().splitlines()}
    assert loaded.bootstrap and loaded.slurm_access and keys
    assert not keys & set(secret_fields()), "secrets are credentials, not config.yaml"
    named = set()
    for path in [*all_units(), *DROPINS.glob("*.conf"), *(UNITS / "env").glob("*.env.example")]:
        for env in re.findall(r"TRAINMEDIC_([A-Z0-9_]+)", path.read_text()):
            field_name = env.lower()
            named.add(field_name if field_name in Settings.model_fields else field_name.removesuffix("_file"))
    missing = set(Settings.model_fields) - keys - named - set(NOT_FOR_SITES)
    assert not missing, f"settings neither in config.yaml.example nor in a unit, drop-in or .env: {sorted(missing)}"


def test_probe_ports_differ_between_the_units_of_one_host() -> None:
    for host in (CENTRAL, NODE):
        ports = {s: _env_assignments(parse_unit(unit_path(s)))["TRAINMEDIC_METRICS_PORT"] for s in host}
        assert len(set(ports.values())) == len(ports), ports
        for short in host:
            assert parse_unit(unit_path(short)).value("Unit", "PartOf") in (
                "trainmedic-central.target",
                "trainmedic-node.target",
            )


# -- starting each unit's ExecStart as systemd would -----------------------------------------


@dataclass
class Site:
    """A host's /etc/trainmedic, credentials and /var/lib, under tmp_path."""

    root: Path
    bootstrap: str
    credentials: dict[str, str] = field(default_factory=dict)
    # Credentials as systemd 255+ hands them over on a file system with ACLs (tmpfs noswap):
    # 0400 plus an ACL entry granting the service's user read, which stat shows as 0440.
    credential_acl: bool = False

    def __post_init__(self) -> None:
        self.etc = self.root / "etc" / "trainmedic"
        self.etc.mkdir(parents=True, exist_ok=True)
        self.state = self.root / "var-lib"
        self.run = self.root / "run"
        (self.etc / "config.yaml").write_text(f"bootstrap: {self.bootstrap}\n")


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]
    cwd: Path | None
    metrics: str
    pre: list[list[str]] = field(default_factory=list)  # ExecStartPre=, in order
    umask: int = 0o022  # UMask=


def _specifiers(value: str, unit: str, site: Site) -> str:
    def one(m: re.Match[str]) -> str:
        spec = m.group(1)
        if spec == "d":
            return str(site.root / "credentials" / unit)
        if spec == "S":
            return str(site.state)
        if spec == "t":
            return str(site.run)
        if spec == "%":
            return "%"
        raise AssertionError(f"{unit}: specifier %{spec} is not materialised by this test")

    return re.sub(r"%(.)", one, value)


def _read_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        name, sep, value = line.partition("=")
        assert sep, f"{path}: not NAME=value: {raw!r}"
        value = value.strip()
        # systemd: a quoted value loses its quotes; an unquoted one is kept whole, spaces and all.
        out[name.strip()] = shlex.split(value)[0] if value[:1] in "\"'" else value
    return out


# POSIX ACL extended attribute (linux/posix_acl_xattr.h): version 2, then (tag, perm, id) entries.
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def _grant_read_by_acl(path: Path, uid: int) -> None:
    """What systemd's write_credential() does on a file system with ACLs: an entry `user:UID:r`
    (the mask becomes r--, so stat's group bits read r--); without ACLs here, the same mode."""
    entries = [
        (_ACL_USER_OBJ, 4, _ACL_UNDEFINED_ID),
        (_ACL_USER, 4, uid),
        (_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED_ID),
        (_ACL_MASK, 4, _ACL_UNDEFINED_ID),
        (_ACL_OTHER, 0, _ACL_UNDEFINED_ID),
    ]
    data = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", data)
    except OSError:
        path.chmod(0o440)


def write_credential(path: Path, value: str, acl: bool) -> None:
    """A credential as systemd writes it for the unit: the value, mode 0400 (then the ACL)."""
    path.unlink(missing_ok=True)
    path.write_text(value + "\n")
    path.chmod(0o400)
    if acl:
        _grant_read_by_acl(path, os.getuid())


def _exec_words(line: str, unit: str, site: Site, env: dict[str, str]) -> list[str]:
    """An Exec*= command line as systemd splits it: specifiers, then ${VAR} in words and $VAR alone
    split into words (none when empty)."""
    argv: list[str] = []
    for word in shlex.split(_specifiers(line.lstrip("-@+!:"), unit, site)):
        whole = re.fullmatch(r"\$(\w+)", word)
        if whole:
            argv.extend(env.get(whole.group(1), "").split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def unit_command(
    short: str,
    site: Site,
    overrides: dict[str, str] | None = None,
    dropins: tuple[str, ...] = (),
    site_dropins: tuple[str, ...] = (),
) -> Command:
    """The process systemd would start for trainmedic-<short>.service on `site`: with the named
    drop-ins of infra/systemd/dropins, then the site's own (drop-in texts, `systemctl edit`)."""
    path = unit_path(short)
    unit = parse_unit(path).merged(
        *(parse_unit(DROPINS / d) for d in dropins),
        *(parse_unit_text(f"{path.name}.d/site-{i}.conf", t) for i, t in enumerate(site_dropins)),
    )
    svc = "Service"
    for state in unit.values(svc, "StateDirectory"):
        (site.state / state).mkdir(parents=True, exist_ok=True)
    runtime_mode = int(unit.value(svc, "RuntimeDirectoryMode") or "0755", 8)
    runtime = [site.run / d for d in unit.values(svc, "RuntimeDirectory")]
    for folder in runtime:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(runtime_mode)
    creds = site.root / "credentials" / path.name
    creds.mkdir(parents=True, exist_ok=True)
    for spec in unit.values(svc, "LoadCredential"):
        name, _, source = spec.partition(":")
        assert source.startswith("/etc/trainmedic/"), f"{path.name}: credential {name} from {source}"
        assert name in site.credentials, f"the test has no value for credential {name} of {path.name}"
        write_credential(creds / name, site.credentials[name], site.credential_acl)
    env = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", "HOME": str(site.root), "CREDENTIALS_DIRECTORY": str(creds)}
    if runtime:
        env["RUNTIME_DIRECTORY"] = ":".join(str(f) for f in runtime)
    # The installed default /etc/trainmedic/config.yaml is this site's.
    env["TRAINMEDIC_CONFIG"] = str(site.etc / "config.yaml")
    for name, value in _env_assignments(unit).items():
        env[name] = _specifiers(value, path.name, site)
    port = free_port()
    for spec in unit.values(svc, "EnvironmentFile"):
        optional, file = spec.startswith("-"), spec.lstrip("-")
        assert file.startswith("/etc/trainmedic/"), f"{path.name}: EnvironmentFile={spec}"
        local = site.etc / file.removeprefix("/etc/trainmedic/")
        # The site's file: the example, then its own choices (the last assignment wins).
        example = UNITS / "env" / f"{local.name}.example"
        text = example.read_text() if example.is_file() else ""
        site_lines = {"TRAINMEDIC_METRICS_PORT": str(port), **(overrides or {})}
        local.write_text(text + "".join(f"{k}={shlex.quote(v)}\n" for k, v in site_lines.items()))
        assert optional or local.is_file()
        env.update(_read_env_file(local))  # EnvironmentFile= wins over Environment=
    exec_start = unit.value(svc, "ExecStart")
    assert exec_start, f"{path.name}: no ExecStart"
    argv = _exec_words(exec_start, path.name, site, env)
    assert argv[0] == INSTALLED, f"{path.name}: ExecStart runs {argv[0]}"
    argv[0] = TRAINMEDIC
    pre = [_exec_words(line, path.name, site, env) for line in unit.values(svc, "ExecStartPre")]
    for words in pre:
        assert Path(words[0]).is_absolute() and Path(words[0]).exists(), f"{path.name}: ExecStartPre runs {words[0]}"
    cwd = unit.value(svc, "WorkingDirectory")
    host = env.get("TRAINMEDIC_METRICS_HOST", "127.0.0.1")
    return Command(
        argv,
        env,
        Path(_specifiers(cwd, path.name, site)) if cwd else None,
        f"http://{host}:{env.get('TRAINMEDIC_METRICS_PORT', port)}",
        pre,
        int(unit.value(svc, "UMask") or "0022", 8),
    )


def run_pre(cmd: Command) -> None:
    """ExecStartPre=, as the service's user with its UMask=: each must exit 0 (else no start)."""
    for words in cmd.pre:
        done = subprocess.run(
            words, env=cmd.env, cwd=cmd.cwd, capture_output=True, text=True, timeout=60, umask=cmd.umask
        )
        assert done.returncode == 0, f"ExecStartPre {' '.join(words)} exited {done.returncode}: {done.stderr}"


def run_one_shot(cmd: Command, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    run_pre(cmd)
    return subprocess.run(cmd.argv, env=cmd.env, cwd=cmd.cwd, capture_output=True, text=True, timeout=timeout)


@dataclass
class Running:
    launched: Launched
    ready: dict[str, object]
    cmd: Command


def started(cmd: Command, log: Path, timeout: float = 120.0) -> Running:
    run_pre(cmd)
    launched = start(cmd.argv, cmd.env, log, cwd=cmd.cwd)
    try:
        return Running(launched, wait_ready(launched, f"{cmd.metrics}/readyz", timeout), cmd)
    except BaseException:
        stop(launched)
        raise


def stopped_cleanly(running: Running) -> None:
    """SIGTERM, as KillSignal= sends: a clean exit 0 (Restart=on-failure leaves it stopped)."""
    code = stop(running.launched)
    assert code == 0, f"{' '.join(running.cmd.argv)} exited {code} on SIGTERM:\n{running.launched.output()}"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    return cert.read_text(), key.read_text()


def _https(url: str, cert_pem: str, token: str | None = None) -> int:
    context = ssl.create_default_context(cadata=cert_pem)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), context=context, timeout=10) as resp:
        return int(resp.status)


def test_topics_then_migrate_then_audit_sink_and_api(tmp_path: Path, certificate: tuple[str, str]) -> None:
    """The central host's order: the one-shots, then the services that need them (one chDB
    folder, used by one process at a time); the API with its TLS and viewer-token drop-ins."""
    bare = EmbeddedBroker().start()  # no topics: the one-shot makes them
    try:
        site = Site(tmp_path, bare.bootstrap)
        cert, key = certificate
        site.credentials = {
            "clickhouse-url": f"chdb://{tmp_path / 'audit'}",
            "token": "o" * 32,
            "viewer-token": "v" * 32,
            "api-tls-cert": cert,
            "api-tls-key": key,
        }
        topics = run_one_shot(unit_command("topics", site))
        assert topics.returncode == 0, topics.stdout + topics.stderr
        from confluent_kafka.admin import AdminClient

        listed = AdminClient({"bootstrap.servers": bare.bootstrap}).list_topics(timeout=10).topics
        assert {t.name for t in ALL_TOPICS} <= set(listed)
        migrate = run_one_shot(unit_command("audit-migrate", site))
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        assert (tmp_path / "audit").is_dir()  # the URL came from the credential

        sink = started(unit_command("audit-sink", site), tmp_path / "sink.log")
        assert sink.ready["loops"]["audit-sink"]["ready"]  # type: ignore[index]
        stopped_cleanly(sink)

        api_port = free_port()
        cmd = unit_command(
            "api",
            site,
            {"TRAINMEDIC_API_LISTEN": f"127.0.0.1:{api_port}"},
            dropins=("api-tls.conf", "api-viewer-token.conf"),
        )
        assert cmd.env["TRAINMEDIC_MODES_FILE"].startswith(str(site.state / "trainmedic" / "api"))
        api = started(cmd, tmp_path / "api.log")
        try:
            assert _https(f"https://127.0.0.1:{api_port}/api/recommendations", cert, "v" * 32) == 200
            with pytest.raises(urllib.error.HTTPError) as refused:
                _https(f"https://127.0.0.1:{api_port}/api/recommendations", cert, "w" * 32)
            assert refused.value.code == 401
        finally:
            stopped_cleanly(api)

        # The executor with dropins/executor-audit.conf: the audit from the same credential, so the
        # automatic return to service (off in this policy) has its loop beside the executor.
        executor = started(unit_command("executor", site, dropins=("executor-audit.conf",)), tmp_path / "executor.log")
        try:
            assert "auto-return" in executor.ready["loops"], executor.ready  # type: ignore[operator]
        finally:
            stopped_cleanly(executor)
    finally:
        bare.stop(grace_s=0)


def test_streams_executor_and_ingest_start_until_ready(
    broker: EmbeddedBroker, tmp_path: Path, certificate: tuple[str, str]
) -> None:
    cert, key = certificate
    site = Site(tmp_path, broker.bootstrap)
    site.credentials = {"ingest-token": "i" * 32, "ingest-tls-cert": cert, "ingest-tls-key": key}
    streams = started(unit_command("streams", site), tmp_path / "streams.log")
    try:
        assert streams.ready["loops"]["streams"]["why"] == "consuming"  # type: ignore[index]
    finally:
        stopped_cleanly(streams)
    assert any((site.state / "trainmedic" / "streams").iterdir())  # Faust's tables in the StateDirectory

    executor = started(unit_command("executor", site), tmp_path / "executor.log")
    stopped_cleanly(executor)

    # The TLS drop-in's $INGEST_TLS becomes --tls-cert/--tls-key from the credentials; this
    # site keeps it on loopback (its .env wins over the drop-in's INGEST_HOST).
    port = free_port()
    cmd = unit_command("ingest", site, {"INGEST_HOST": "127.0.0.1", "INGEST_PORT": str(port)}, ("ingest-tls.conf",))
    assert "--tls-cert" in cmd.argv and "--tls-key" in cmd.argv
    ingest = started(cmd, tmp_path / "ingest.log", timeout=60)
    try:
        assert _https(f"https://127.0.0.1:{port}/healthz", cert) == 200
    finally:
        stopped_cleanly(ingest)


def test_gpu_without_nvml_says_so(broker: EmbeddedBroker, tmp_path: Path) -> None:
    proc = run_one_shot(unit_command("gpu", Site(tmp_path, broker.bootstrap)), timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # Unavailable, not a usage error (2)
    assert "NVML" in proc.stderr and "Usage:" not in proc.stderr


def test_ib_without_an_rdma_driver_says_so(broker: EmbeddedBroker, tmp_path: Path) -> None:
    # No InfiniBand adapter here: /sys/class/infiniband is absent (docs/environment.md).
    proc = run_one_shot(unit_command("ib", Site(tmp_path, broker.bootstrap)), timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no InfiniBand / RoCE device driver is loaded" in proc.stderr and "Usage:" not in proc.stderr


def test_node_agent_without_nvml_says_so(broker: EmbeddedBroker, tmp_path: Path) -> None:
    cmd = unit_command("node-agent", Site(tmp_path, broker.bootstrap))
    assert cmd.argv[1:] == [
        "run",
        "node-agent",
        "--state-dir",
        str(tmp_path / "var-lib" / "trainmedic" / "node-agent"),
        "--reset-command",
        "nvidia-smi --gpu-reset -i {gpu}",  # one word: ${RESET_COMMAND}
        "--reset-all-command",
        "nvidia-smi --gpu-reset",
    ]
    proc = run_one_shot(cmd, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # Unavailable, not a usage error (2)
    assert "NVML is not available" in proc.stderr and "Usage:" not in proc.stderr


@pytest.fixture
def exporter() -> Iterator[str]:
    """A dcgm-exporter stand-in serving the captured exposition."""
    body = (FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_dcgm_and_kernel_producers_publish(broker: EmbeddedBroker, tmp_path: Path, exporter: str) -> None:
    site = Site(tmp_path, broker.bootstrap)
    dcgm = started(unit_command("dcgm", site, {"DCGM_URL": exporter}), tmp_path / "dcgm.log")
    stopped_cleanly(dcgm)
    hosts = set(re.findall(r'Hostname="([^"]+)"', (FIXTURES / "dcgm" / "dcgm_exporter_metrics.prom").read_text()))
    samples = wait_for("GPU samples from dcgm", lambda: read_topic(broker.bootstrap, "gpu.samples"), timeout=30)
    assert all(any(f'"{h}"'.encode() in s for s in samples) for h in hosts)

    # A site reading its kern.log: KERNEL_SOURCE in kernel.env, split into words as systemd does.
    kern = tmp_path / "kern.log"
    kern.write_text(
        "Dec  2 11:38:47 gpu99 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', "
        "name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer.\n"
    )
    cmd = unit_command("kernel", site, {"KERNEL_SOURCE": f"--file {kern}", "TRAINMEDIC_NODE": "gpu99"})
    assert cmd.argv[2:5] == ["kernel", "--file", str(kern)]
    kernel = started(cmd, tmp_path / "kernel.log")
    try:
        events = wait_for("the Xid event", lambda: read_topic(broker.bootstrap, "node.kernel"), timeout=30)
        assert any(b"gpu99" in e for e in events)
    finally:
        stopped_cleanly(kernel)
    assert list((site.state / "trainmedic" / "kernel").glob("*.json"))  # its position, in the StateDirectory


@pytest.mark.skipif(shutil.which("journalctl") is None, reason="needs journalctl")
def test_kernel_producer_as_installed_reads_the_journal(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The unit's default source (--journal): ready once journalctl -k -f runs (no journal
    here: it waits for entries, as on a quiet node)."""
    cmd = unit_command("kernel", Site(tmp_path, broker.bootstrap))
    assert "--journal" in cmd.argv
    kernel = started(cmd, tmp_path / "kernel.log", timeout=60)
    assert "journalctl" in kernel.ready["loops"]["producer-kernel"]["why"]  # type: ignore[index]
    stopped_cleanly(kernel)


@pytest.mark.slurm
def test_slurm_producer_and_job_logs_with_the_local_cluster(
    slurm_cluster: Cluster, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    site = Site(tmp_path, broker.bootstrap)
    conf = {"SLURM_CONF": slurm_cluster.slurm_conf}
    producer = started(unit_command("slurm-producer", site, conf), tmp_path / "slurm.log")
    stopped_cleanly(producer)
    assert (site.state / "trainmedic" / "slurm-producer" / "state.json").is_file()
    logs = started(unit_command("logs", site, conf), tmp_path / "logs.log")
    stopped_cleanly(logs)


# -- the webhook notifier (optional) ----------------------------------------------------------

# What docs/deploy-bare-metal.md has a site add for an endpoint's bearer token
# (`systemctl edit trainmedic-notifier`); the webhooks YAML then says `token_file: hook-token`.
NOTIFIER_TOKEN_LINE = "LoadCredential=hook-token:/etc/trainmedic/credentials/hook-token"
NOTIFIER_TOKEN_DROPIN = f"[Service]\n{NOTIFIER_TOKEN_LINE}\n"
HOOK_TOKEN = "n0t1f1er-hook-token-0123456789abcdef"


@needs_analyze
def test_the_notifier_token_dropin_of_the_docs_verifies(tmp_path: Path) -> None:
    dropin = {"trainmedic-notifier.service.d/hook-token.conf": NOTIFIER_TOKEN_DROPIN}
    assert analyze_verify(installed_copy(tmp_path / "units", dropin), ["trainmedic-notifier.service"]) == []
    assert NOTIFIER_TOKEN_LINE in (REPO / "docs" / "deploy-bare-metal.md").read_text()


@dataclass
class Hook:
    path: str
    headers: dict[str, str]  # names lower-cased
    body: dict[str, Any]


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[Hook]]]:
    """A webhook receiver on 127.0.0.1 (plain http is allowed to loopback) recording every POST."""
    got: list[Hook] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            got.append(Hook(self.path, {k.lower(): v for k, v in self.headers.items()}, orjson.loads(body)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    server.shutdown()
    server.server_close()


def _notifier_site(root: Path, bootstrap: str, url: str, acl: bool) -> Site:
    site = Site(root, bootstrap, credential_acl=acl)
    site.credentials = {
        "notifier.yaml": (
            f"endpoints:\n  - name: receiver\n    url: {url}\n    token_file: hook-token\n"
            "retry: {attempts: 3, base_delay_s: 0.1, max_delay_s: 0.5}\n"
        ),
        "hook-token": HOOK_TOKEN,
    }
    return site


def _incident(incident_id: str) -> Incident:
    now = time.time()
    return Incident(
        event_id=incident_id,
        event_time=now,
        incident_id=incident_id,
        job_id="4242",
        partition="gpu",
        job_nodes=["gpu01", "gpu02"],
        category="gpu_hardware",
        severity="critical",
        culprit_node="gpu02",
        culprit_gpu=1,
        confidence=0.9,
        isolate=True,
        explanation="Xid 79 on gpu02",
        evidence=[
            Evidence(source="kernel", signature="xid_79", node="gpu02", time=now - 2, line="NVRM: Xid 79", role="root")
        ],
        anomaly_ids=["anm-4242-1"],
        first_signal_time=now - 2,
    )


@pytest.mark.parametrize("acl", [False, True], ids=["credentials-0400", "credentials-acl-0440"])
def test_notifier_delivers_an_incident_with_its_token_credential(
    broker: EmbeddedBroker, tmp_path: Path, webhook: tuple[str, list[Hook]], acl: bool
) -> None:
    """The unit with the token drop-in, its YAML and token as credentials (as systemd 252 writes
    them, 0400, and as systemd 255+ does on tmpfs, 0400 plus an ACL: 0440): ExecStartPre copies
    them into the RuntimeDirectory 0400, the notifier gets ready, POSTs a published incident
    with the token, and exits 0 on SIGTERM."""
    url, got = webhook
    site = _notifier_site(tmp_path, broker.bootstrap, url, acl)
    cmd = unit_command("notifier", site, site_dropins=(NOTIFIER_TOKEN_DROPIN,))
    runtime = Path(cmd.env["RUNTIME_DIRECTORY"])
    assert cmd.argv[1:] == ["run", "notifier", "--webhooks", str(runtime / "notifier.yaml")]
    raw = Path(cmd.env["CREDENTIALS_DIRECTORY"]) / "hook-token"
    if acl:  # why the copy: the notifier refuses the credential as systemd 255+ hands it over
        assert stat.S_IMODE(raw.stat().st_mode) == 0o440
        with pytest.raises(NotifierConfigError, match="0440"):
            read_token(raw)
    notifier = started(cmd, tmp_path / "notifier.log")
    try:
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        copies = {p.name: stat.S_IMODE(p.stat().st_mode) for p in runtime.iterdir()}
        assert copies == {"notifier.yaml": 0o400, "hook-token": 0o400}
        pub = Publisher(broker.bootstrap, "test", learn_limits=False)
        pub.publish(INCIDENTS, _incident("inc-systemd-unit-1"))
        assert pub.flush(10) == 0
        hooks = wait_for(
            "the incident at the webhook",
            lambda: [h for h in got if h.body.get("event", {}).get("event_id") == "inc-systemd-unit-1"],
            timeout=60,
        )
        assert hooks[0].path == "/hook" and hooks[0].body["kind"] == "incident"
        assert hooks[0].headers["authorization"] == f"Bearer {HOOK_TOKEN}"
        assert hooks[0].headers["idempotency-key"].startswith("ntf-")
    finally:
        stopped_cleanly(notifier)


def test_notifier_without_its_token_credential_exits_2_naming_the_field(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """A YAML naming a token the unit does not load (the drop-in forgotten): exit 2, which
    RestartPreventExitStatus= does not restart, and the journal names the file, line and field."""
    site = _notifier_site(tmp_path, broker.bootstrap, "http://127.0.0.1:9/hook", acl=True)
    done = run_one_shot(unit_command("notifier", site), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "notifier.yaml: line 4: field 'endpoints.0.token_file'" in done.stderr, done.stderr
    assert "Usage:" not in done.stderr
