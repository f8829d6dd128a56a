"""The one settings model: precedence, secrets from files, refusals, provenance, the cluster name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.config import KafkaSecurity, consumer_config, producer_config, security
from schemas.events import GpuSample
from schemas.ids import DEFAULT_CLUSTER, cluster_scoped, current_cluster, set_cluster, stable_id
from trainmedic.settings import Settings, SettingsError, apply, provenance, unknown_env


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for name in list(os.environ):
        if name.startswith("TRAINMEDIC_"):
            monkeypatch.delenv(name)
    yield
    set_cluster(DEFAULT_CLUSTER)
    from bus.config import configure_security

    configure_security(KafkaSecurity())


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_flag_over_env_over_file_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _file(tmp_path, "settle_s: 3\ncollateral_s: 9\nbootstrap: file:9092\n")
    monkeypatch.setenv("TRAINMEDIC_SETTLE_S", "2")
    monkeypatch.setenv("TRAINMEDIC_COLLATERAL_S", "8")
    s = Settings.load(cfg, collateral_s=7.0, bootstrap=None)
    assert s.collateral_s == 7.0  # flag
    assert s.settle_s == 2.0  # env over file
    assert s.bootstrap == "file:9092"  # file; a flag given as None is "not given"
    assert s.fetch_max_wait_ms == 100  # default
    origins = {name: origin for name, _, origin in provenance(cfg, collateral_s=7.0)}
    assert origins["collateral_s"] == "flag"
    assert origins["settle_s"] == "env TRAINMEDIC_SETTLE_S"
    assert origins["bootstrap"] == f"config file {cfg}"
    assert origins["fetch_max_wait_ms"] == "default"


def test_config_file_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMEDIC_CONFIG", str(_file(tmp_path, "cluster: east\n")))
    assert Settings.load().cluster == "east"


def test_secrets_from_files_are_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ch").write_text("http://audit:s3cret@ch:8123/trainmedic\n")
    (tmp_path / "tok").write_text("op-token\n")
    cfg = _file(tmp_path, f"clickhouse_url_file: {tmp_path / 'ch'}\n")
    monkeypatch.setenv("TRAINMEDIC_TOKEN_FILE", str(tmp_path / "tok"))
    s = Settings.load(cfg)
    assert s.secret("clickhouse_url") == "http://audit:s3cret@ch:8123/trainmedic"
    assert s.secret("token") == "op-token"
    rows = {name: (value, origin) for name, value, origin in provenance(cfg)}
    assert rows["clickhouse_url"][0] == rows["token"][0] == "********"
    assert "s3cret" not in repr(s) and "op-token" not in repr(s)
    assert rows["token"][1].startswith("file named by TRAINMEDIC_TOKEN_FILE")
    assert rows["clickhouse_url"][1].startswith("file named by clickhouse_url_file")


def test_env_secret_file_wins_over_config_file_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").write_text("from-env-file")
    cfg = _file(tmp_path, "token: from-config\n")
    monkeypatch.setenv("TRAINMEDIC_TOKEN_FILE", str(tmp_path / "a"))
    assert Settings.load(cfg).secret("token") == "from-env-file"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("bootstrapp: x:9092\n", "unknown setting(s) bootstrapp"),
        ("settle_s: -1\n", "settle_s"),
        ("cluster: East_1\n", "cluster"),
        ("- a\n- b\n", "expected a mapping"),
        ("token_file: /nonexistent/token\n", "token_file=/nonexistent/token"),
    ],
)
def test_bad_config_names_what_is_wrong(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        Settings.load(_file(tmp_path, text))
    assert needle in str(err.value)


def test_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="config file .*nope.yaml"):
        Settings.load(tmp_path / "nope.yaml")


def test_unknown_trainmedic_env_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMEDIC_BOOTSTRAPP", "x")
    monkeypatch.setenv("TRAINMEDIC_SLURM_DIR", "/tmp/x")  # the local Slurm scripts' own
    monkeypatch.setenv("TRAINMEDIC_BOOTSTRAP", "k:9092")
    assert unknown_env() == ["TRAINMEDIC_BOOTSTRAPP"]


def test_apply_sets_cluster_and_kafka_security(tmp_path: Path) -> None:
    s = Settings.load(
        None,
        cluster="east",
        kafka_security_protocol="sasl_ssl",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="tm",
        kafka_sasl_password="pw",
        kafka_ssl_ca=tmp_path / "ca.pem",
    )
    apply(s)
    assert current_cluster() == "east"
    assert security().protocol == "sasl_ssl"
    for cfg in (producer_config("k:9093", "c"), consumer_config("k:9093", "g", "c")):
        assert cfg["security.protocol"] == "sasl_ssl"
        assert cfg["sasl.mechanism"] == "SCRAM-SHA-512"
        assert cfg["sasl.username"] == "tm" and cfg["sasl.password"] == "pw"
        assert cfg["ssl.ca.location"] == str(tmp_path / "ca.pem")


def test_incomplete_sasl_is_refused_at_start() -> None:
    with pytest.raises(SettingsError, match="SASL mechanism, username and password"):
        apply(Settings.load(None, kafka_security_protocol="sasl_plaintext", kafka_sasl_username="tm"))


def test_cluster_in_ids_events_and_groups() -> None:
    default_id = stable_id("anom", "job-1", 7)
    assert cluster_scoped("trainmedic-executor") == "trainmedic-executor"
    set_cluster("east")
    east_id = stable_id("anom", "job-1", 7)
    assert east_id != default_id  # job ids repeat across clusters; their ids must not
    assert cluster_scoped("trainmedic-executor") == "trainmedic-executor.east"
    sample = GpuSample(event_id="g1", event_time=1.0, node="gpu01", gpus=[])
    assert sample.cluster == "east"
    set_cluster(DEFAULT_CLUSTER)
    assert stable_id("anom", "job-1", 7) == default_id  # a single-cluster site keeps its ids
    with pytest.raises(ValueError, match="DNS label"):
        set_cluster("East")


def test_config_show_masks_secrets_and_names_origins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from trainmedic.cli.main import app

    cfg = _file(tmp_path, "bootstrap: kafka-1:9092\ntoken: s3cret-token\n")
    monkeypatch.setenv("TRAINMEDIC_CLUSTER", "east")
    monkeypatch.setenv("TRAINMEDIC_BOOTSTRAPP", "typo:9092")
    result = CliRunner().invoke(app, ["--config", str(cfg), "config", "show", "--json"])
    assert result.exit_code == 0, result.output
    assert "s3cret-token" not in result.output
    shown = {row["name"]: row for row in json.loads(result.stdout)["settings"]}
    assert shown["token"]["value"] == "********"
    assert shown["bootstrap"] == {"name": "bootstrap", "value": "kafka-1:9092", "origin": f"config file {cfg}"}
    assert shown["cluster"]["origin"] == "env TRAINMEDIC_CLUSTER"
    assert json.loads(result.stdout)["unknown_env"] == ["TRAINMEDIC_BOOTSTRAPP"]
    bad = CliRunner().invoke(app, ["--config", str(tmp_path / "missing.yaml"), "config", "show"])
    assert bad.exit_code == 2 and "missing.yaml" in bad.stderr


def test_clickhouse_credentials_settings_go_into_the_url() -> None:
    from trainmedic.settings import clickhouse_dsn

    s = Settings.load(
        None, clickhouse_url="https://ch:8443/trainmedic", clickhouse_user="audit", clickhouse_password="p@ss"
    )
    assert clickhouse_dsn(s) == "https://audit:p%40ss@ch:8443/trainmedic"
    # A URL that names its own user keeps it; chDB has no credentials.
    assert clickhouse_dsn(Settings.load(None, clickhouse_url="http://u:x@ch:8123", clickhouse_user="audit")) == (
        "http://u:x@ch:8123"
    )
    assert clickhouse_dsn(Settings.load(None, clickhouse_url="chdb:///var/audit", clickhouse_user="a")) == (
        "chdb:///var/audit"
    )


def test_the_streams_worker_reads_the_settings_without_importing_sinks() -> None:
    import subprocess
    import sys

    probe = "import sys, streams.app; print(sorted(m for m in sys.modules if m.split('.')[0] == 'sinks'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_node_names_map_onto_slurm_node_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("node_map:\n  k8s-worker-a.example.org: gpu07\nnode_strip_domain: true\n")
    s = Settings.load(cfg)
    assert s.slurm_node("k8s-worker-a.example.org") == "gpu07"  # the map first
    assert s.slurm_node("gpu02.example.org") == "gpu02"
    assert Settings.load().slurm_node("gpu02.example.org") == "gpu02.example.org"  # nothing stripped by default
    monkeypatch.setenv("TRAINMEDIC_NODE", "k8s-worker-a.example.org")
    assert Settings.load(cfg).slurm_node() == "gpu07"
    monkeypatch.setenv("TRAINMEDIC_NODE_MAP", "gpu01=gpu02")
    with pytest.raises(SettingsError, match="node_map.*JSON"):
        Settings.load()


def test_a_misspelt_variable_is_named_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from trainmedic.cli.main import app

    monkeypatch.setenv("TRAINMEDIC_BOOTSTRAPP", "kafka:9092")
    result = CliRunner().invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0
    assert "TRAINMEDIC_BOOTSTRAPP names no setting" in result.stderr
    monkeypatch.delenv("TRAINMEDIC_BOOTSTRAPP")
    assert "no setting" not in CliRunner().invoke(app, ["config", "show", "--json"]).stderr
