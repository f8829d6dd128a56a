"""Secrets never leave a process in the clear (issue 40, item 4).

A distinct, greppable value is planted in every secret setting (every SecretStr field of
trainmedic.settings.Settings, so a secret setting added later is planted too) and in the
password of each ClickHouse URL the processes are given; then every way out is read and
searched for each value, raw and URL-quoted:

- one-shot commands that cannot reach the audit: the URL in the environment, on the command
  line (`--clickhouse`), or built from the clickhouse_user / clickhouse_password settings;
  `up` that cannot open ClickHouse; `config show` (table and JSON): stdout, stderr, logs;
- a running `up` (real embedded broker, streams worker, chDB): its start banner, the API's
  errors (a bundle's 404 to a read-only token, 401), /api/health, `/metrics`, `/healthz` and
  `/readyz` of `up` and of its streams worker, every log file, and commands run beside it and
  after it (the audit locked, a bundle of an incident that is not there);
- an incident bundle whose sources failed with messages that carry the secrets.

No ClickHouse server can run here, so the running `up` is given a chDB URL carrying its password
as a query parameter (`chdb:///folder?password=...`, which chDB ignores): the same string a
server URL `http://user:password@host:8123` would put in every message.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.conftest import wait_for
from trainmedic.settings import secret_fields
from trainmedic.stack.broker import free_port

TRAINMEDIC = [sys.executable, "-m", "trainmedic.cli.main"]

# The ClickHouse URLs' own passwords (not settings of their own: the URL is the setting).
URL_PASSWORD = "SEKRIT-url-password-7f3a"
FLAG_PASSWORD = "SEKRIT-flag-password-1c9e"
CHDB_PASSWORD = "SEKRIT-chdb-password-52d0"
# clickhouse_password has characters a URL quotes: the DSN built from it holds the quoted form.
CH_PASSWORD = "SEKRIT-ch:pass/word@66b1"


def planted_settings() -> dict[str, str]:
    """A distinct value for every secret setting (clickhouse_url: set per scenario)."""
    values = {name: f"SEKRIT-{name.replace('_', '-')}-{i:02d}x9q" for i, name in enumerate(secret_fields())}
    values["clickhouse_password"] = CH_PASSWORD
    values.pop("clickhouse_url")
    return values


def needles(extra: Iterable[str] = ()) -> set[str]:
    """What must appear nowhere: every planted value, raw and as a URL quotes it."""
    raw = {*planted_settings().values(), URL_PASSWORD, FLAG_PASSWORD, CHDB_PASSWORD, *extra}
    return raw | {quote(v, safe="") for v in raw}


def base_env(clickhouse_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    env.update({f"TRAINMEDIC_{k.upper()}": v for k, v in planted_settings().items()})
    # Kafka stays plaintext: the SASL password is set, and unused.
    env.update(TRAINMEDIC_CLICKHOUSE_URL=clickhouse_url, TRAINMEDIC_CLICKHOUSE_USER="audit", COLUMNS="400")
    env.update(extra)
    return env


class Outputs:
    """Every output read, by where it came from; `leaks()` names those holding a planted value."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def add(self, where: str, text: str | bytes) -> None:
        self.seen[where] = text.decode(errors="replace") if isinstance(text, bytes) else text

    def run(
        self, where: str, argv: list[str], env: dict[str, str], expect_ok: bool
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*TRAINMEDIC, *argv], env=env, capture_output=True, text=True, timeout=120)
        self.add(f"{where}: stdout", proc.stdout)
        self.add(f"{where}: stderr", proc.stderr)
        assert (proc.returncode == 0) == expect_ok, f"{where}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        return proc

    def files(self, where: str, folder: Path) -> None:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            self.add(f"{where}/{path.relative_to(folder)}", path.read_bytes())

    def leaks(self, secrets: set[str]) -> dict[str, list[str]]:
        return {
            where: sorted(s for s in secrets if s in text)
            for where, text in self.seen.items()
            if any(s in text for s in secrets)
        }


def http(url: str, token: str | None = None, data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {token}"} if token else {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_one_shot_commands_that_fail_print_no_secret(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there: every ClickHouse call fails
    out = Outputs()
    env = base_env(f"http://audit:{URL_PASSWORD}@127.0.0.1:{closed}/trainmedic")
    out.run("config show", ["config", "show"], env, expect_ok=True)
    shown = out.run("config show --json", ["config", "show", "--json"], env, expect_ok=True)
    values = {row["name"]: row["value"] for row in json.loads(shown.stdout)["settings"]}
    assert all(values[name] != "-" for name in secret_fields()), "every secret setting is planted"
    out.run("audit incidents (URL in the env)", ["audit", "incidents", "--data-dir", str(tmp_path)], env, False)
    flag = f"http://audit:{FLAG_PASSWORD}@127.0.0.1:{closed}/trainmedic"
    out.run("audit db migrate --clickhouse URL", ["audit", "db", "migrate", "--clickhouse", flag], env, False)
    # The URL names no user: the DSN is built from clickhouse_user and clickhouse_password.
    built = dict(env, TRAINMEDIC_CLICKHOUSE_URL=f"http://127.0.0.1:{closed}/trainmedic")
    out.run("audit db status (password setting)", ["audit", "db", "status"], built, False)
    up_dir = tmp_path / "up"
    out.run(
        "up (ClickHouse unreachable)",
        ["up", "--backend", "simulated", "--api-port", str(free_port()), "--metrics-port", "0"]
        + ["--metrics-address", "off", "--data-dir", str(up_dir)],
        env,
        False,
    )
    out.files("up (ClickHouse unreachable) logs", up_dir / "logs")
    assert "cannot open ClickHouse" in out.seen["audit incidents (URL in the env): stderr"]
    assert out.leaks(needles()) == {}


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], subprocess.Popen[bytes], Path]]:
    """`trainmedic up` on its own data folder, started; (data dir, env, process, its output file)."""
    data = tmp_path / "var"
    env = base_env(f"chdb://{tmp_path / 'audit'}?password={CHDB_PASSWORD}")
    log = tmp_path / "up.out"
    argv = ["up", "--backend", "simulated", "--api-port", str(free_port()), "--metrics-port", str(free_port())]
    argv += ["--metrics-address", f"127.0.0.1:{free_port()}", "--data-dir", str(data)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*TRAINMEDIC, *argv], env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_for(
            "trainmedic is up",
            lambda: "trainmedic is up" in log.read_text(errors="replace") or proc.poll() is not None,
            timeout=120,
        )
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield data, env, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_a_running_up_shows_no_secret(up: tuple[Path, dict[str, str], subprocess.Popen[bytes], Path]) -> None:
    data, env, proc, log = up
    out = Outputs()
    runtime = json.loads((data / "runtime.json").read_text())
    api = runtime["api_url"].rstrip("/")
    token = (data / "api-token").read_text().strip()
    viewer = (data / "api-viewer-token").read_text().strip()
    # The bundle of an incident the audit lacks: 404 to a read-only token holder.
    status, body = http(f"{api}/api/incidents/inc-not-there/bundle", viewer)
    assert status == 404 and b"?password=********" in body, body  # it still names the audit it searched
    out.add("API bundle 404", body)
    status, body = http(f"{api}/api/recommendations", planted_settings()["token"])
    assert status == 401, body
    out.add("API 401", body)
    status, body = http(f"{api}/api/replay", viewer, data=b'{"not": "a replay"}')
    assert status in (400, 422), body
    out.add("API 4xx on a bad body", body)
    out.add("API /api/health", http(f"{api}/api/health")[1])
    listeners = [("up", runtime["metrics_url"])] + [("streams worker", u) for u in runtime["worker_metrics_urls"]]
    assert len(listeners) == 2, runtime
    for name, metrics in listeners:
        for path in ("/metrics", "/healthz", "/readyz"):
            out.add(f"{name} {path}", http(metrics.removesuffix("/metrics") + path)[1])
    # Beside the running `up`: the audit folder is its, so the command cannot open it.
    out.run("audit incidents beside up", ["audit", "incidents", "--data-dir", str(data)], env, False)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, log.read_text(errors="replace")[-3000:]
    # After it: the audit opens; a bundle of an incident that is not there is refused.
    bundle = data / "none.tar.gz"
    out.run(
        "audit incident --bundle (no such incident)",
        ["audit", "incident", "inc-not-there", "--bundle", str(bundle), "--data-dir", str(data)],
        env,
        False,
    )
    out.add("up output (banner, logs)", log.read_bytes())
    out.files("up logs", data / "logs")
    banner = next(line for line in out.seen["up output (banner, logs)"].splitlines() if "trainmedic is up" in line)
    assert f"Audit chdb://{data.parent / 'audit'}?password=********," in banner, banner
    assert out.leaks(needles([token, viewer])) == {}


def test_a_bundle_whose_sources_failed_holds_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle writer masks what its sections and gaps carry (a driver's error echoing the DSN)."""
    from trainmedic.ops.bundle import SECTIONS, Bundle, write_bundle
    from trainmedic.settings import Settings

    url = f"http://audit:{URL_PASSWORD}@ch.example:8123/trainmedic"
    for key, value in base_env(url).items():
        if key.startswith("TRAINMEDIC_"):
            monkeypatch.setenv(key, value)
    Settings.load()  # what every process does first: the settings' secrets are its own from then on
    planted = planted_settings()
    bundle = Bundle(
        incident_id="inc-secret",
        created_at=1_700_000_000.0,
        cluster="default",
        window={"audit_start": "a", "audit_end": "b", "gpu_start": "c", "gpu_end": "d"},
        sections={name: [] for name in SECTIONS},
        gaps=[
            f"kernel: not read from the audit (OperationalError: HTTPDriver for {url} refused)",
            f"scheduler: not read from the audit (ValueError: {' '.join(planted.values())})",
            f"gpu.samples: the broker could not be read (password {quote(CH_PASSWORD, safe='')})",
        ],
    )
    bundle.sections["incident"] = [{"incident_id": "inc-secret", "explanation": f"seen at {url}"}]
    path = write_bundle(bundle, tmp_path / "inc.tar.gz")
    out = Outputs()
    with tarfile.open(fileobj=io.BytesIO(path.read_bytes()), mode="r:gz") as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member)
            assert f is not None
            out.add(f"bundle {member.name}", f.read())
    assert "HTTPDriver for http://audit:" in out.seen["bundle README.txt"]  # the message kept, less its secret
    assert out.leaks(needles()) == {}
