"""The one settings model of every trainmedic process (pydantic-settings).

Where a setting comes from, highest first:
  1. a command-line flag (only where a command offers one),
  2. the environment: ``TRAINMEDIC_<NAME>`` (``TRAINMEDIC_BOOTSTRAP``, ``TRAINMEDIC_CLUSTER``...),
  3. the config file: ``--config PATH``, else ``TRAINMEDIC_CONFIG``, else
     ``/etc/trainmedic/config.yaml`` when it exists (keys are the field names below),
  4. the default.
Secrets (fields of type SecretStr) are never needed on a command line: each can also be
read from a file, ``TRAINMEDIC_<NAME>_FILE`` (or ``<name>_file:`` in the config file) -
the form Kubernetes Secrets and systemd credentials take. ``trainmedic config show``
prints the effective settings, secrets masked, with where each came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from bus.config import KafkaSecurity, configure_security, configure_session_timeout
from bus.watchdog import StallSettings
from bus.watchdog import configure as configure_watchdog
from schemas.errors import ConfigError
from schemas.ids import CLUSTER_RE, DEFAULT_CLUSTER, NodeNameError, check_node_name, set_cluster
from schemas.masking import MASK, mask, remember
from schemas.masking import install as mask_process_output
from schemas.topics import DEFAULT_PARTITIONS
from schemas.vocab import Mode
from schemas.yamlsafe import load_yaml

if TYPE_CHECKING:
    from sinks.audit_schema import LayoutSettings

ENV_PREFIX = "TRAINMEDIC_"
CONFIG_ENV = "TRAINMEDIC_CONFIG"
SYSTEM_CONFIG = Path("/etc/trainmedic/config.yaml")

# The config file the sources read while one Settings is being built (see Settings.load).
_config_file: ContextVar[Path | None] = ContextVar("trainmedic_config_file", default=None)


class SettingsError(ConfigError, ValueError):
    """A setting that is missing, malformed or unknown; the message names it and its origin."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, case_sensitive=False)

    # -- identity ---------------------------------------------------------------------
    cluster: str = Field(
        default=DEFAULT_CLUSTER,
        description="name of the Slurm cluster this process serves; in every event, id and audit row",
    )
    node: str | None = Field(
        default=None, description="this host's node name (node producers); unset: the host name; mapped as below"
    )
    node_map: dict[str, str] = Field(
        default_factory=dict,
        description="host or Kubernetes node name -> Slurm NodeName, where they differ (JSON in the env)",
    )
    node_strip_domain: bool = Field(
        default=False, description="report gpu01 for gpu01.example.org (Slurm NodeNames are short host names)"
    )

    # -- node producers -------------------------------------------------------------------
    ib_sysfs_root: Path = Field(
        default=Path("/sys/class/infiniband"),
        description="where `produce ib` reads the InfiniBand / RoCE ports (the kernel's sysfs class directory)",
    )
    ib_interval_s: float = Field(default=10.0, gt=0, le=3600, description="seconds between `produce ib` samples")
    node_key: SecretStr | None = Field(
        default=None,
        description="this node's signing key (64 hex, from `trainmedic ingest node-key NODE`; usually node_key_file: "
        "/etc/trainmedic/node-key, mode 0600): the node producers sign their records with it; unset: unsigned",
    )

    # -- Kafka --------------------------------------------------------------------------
    bootstrap: str | None = Field(
        default=None, description="Kafka bootstrap servers host:port[,...]; unset: the local `trainmedic up`"
    )
    kafka_security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] = "plaintext"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_ca: Path | None = Field(default=None, description="CA bundle (PEM) that signed the brokers' certificates")
    kafka_ssl_certificate: Path | None = Field(default=None, description="client certificate (PEM), mutual TLS")
    kafka_ssl_key: Path | None = Field(default=None, description="client key (PEM), mutual TLS")
    kafka_session_timeout_ms: int = Field(
        default=6000,
        ge=1500,
        le=300_000,
        description="consumer-group session timeout of every consumer and the streams worker; a group join on the "
        "embedded broker takes about half of it; Kafka brokers refuse less than their group.min.session.timeout.ms "
        "(6000 unless configured)",
    )
    consumer_stall_s: float = Field(
        default=20.0,
        gt=0,
        description="a consumer that acts (executor, notifier, node agent) and gets no partition, or does not move "
        "with records waiting, or reads past the log's end this long is stalled: not ready, re-subscribed, then "
        "its group reset at twice this (bus/watchdog.py)",
    )
    consumer_stall_give_up_s: float = Field(
        default=180.0,
        gt=0,
        description="a stall that lasts this long ends the consumer's loop, so that its supervisor (up, Kubernetes, "
        "systemd) restarts it; more than twice consumer_stall_s",
    )

    # -- ClickHouse (audit) ---------------------------------------------------------------
    clickhouse_url: SecretStr | None = Field(
        default=None, description="http(s)://user:password@host:8123/db or chdb:///path; unset: DATA_DIR/audit"
    )
    clickhouse_user: str | None = None
    clickhouse_password: SecretStr | None = None
    ca_bundle: Path | None = Field(
        default=None,
        description="CA bundle (PEM) that verifies the TLS certificates of the operator API (for the CLI) and of an "
        "https ClickHouse; unset: the system's trust store",
    )

    # -- streams worker -------------------------------------------------------------------
    streams_id: str = Field(default="trainmedic-streams", description="Faust app id = its consumer group")
    policy: Path | None = Field(default=None, description="policy YAML; unset: the packaged default policy")
    mode: Mode | None = Field(default=None, description="overrides the policy's mode for every partition")
    modes_file: Path | None = Field(
        default=None,
        description="the API's state file of operator mode changes (DATA_DIR/modes.yaml), when this host sees it",
    )
    settle_s: float = Field(default=1.0, gt=0, description="attribution window once a root cause is seen")
    collateral_s: float = Field(default=5.0, gt=0, description="how long collateral-only symptoms wait")
    cascade_window_s: float = Field(
        default=600.0,
        gt=0,
        description="evidence further apart than this (torch's default NCCL timeout) is not one cascade",
    )
    fetch_max_wait_ms: int = Field(default=100, ge=1, le=1500, description="cap on the Faust consumer's fetch wait")
    fetch_pace_ms: int = Field(
        default=50,
        ge=0,
        le=1000,
        description="the streams worker sends at most one fetch per broker this often (0: as fast as records are "
        "taken); a record waits up to this much longer per hop, and a busy worker and broker handle far fewer requests",
    )
    node_signing_required: bool = Field(
        default=False,
        description="with site_secret: the streams worker refuses unsigned GPU, kernel and port records too "
        "(signed ones that do not verify for their node are refused whenever site_secret is set)",
    )
    streams_data_dir: Path = Field(
        default=Path("trainmedic-streams-data"), description="the streams worker's local Faust data folder (writable)"
    )

    # -- metrics --------------------------------------------------------------------------
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="serve /metrics; unset: off")

    # -- operator API (the CLI's side) ------------------------------------------------------
    api: str | None = Field(default=None, description="operator API URL; unset: the local `trainmedic up`")
    token: SecretStr | None = Field(default=None, description="operator API token; unset: DATA_DIR/api-token")
    viewer_token: SecretStr | None = Field(default=None, description="read-only API token (`run api`); unset: none")
    api_listen: str = Field(default="127.0.0.1:8477", description="HOST:PORT the operator API (`run api`) binds")
    api_tls_cert: Path | None = Field(default=None, description="the API's TLS certificate chain (PEM)")
    api_tls_key: Path | None = Field(default=None, description="the API's TLS private key (PEM)")
    api_insecure: bool = Field(default=False, description="allow the API off loopback without TLS")
    ingest_token: SecretStr | None = Field(
        default=None, description="the shared ingest token: accepted from services (NVSentinel), not for jobs"
    )

    # -- ingest identity (docs/ingest.md, "Identity") -------------------------------------------
    ingest_service_token: SecretStr | None = Field(
        default=None, description="NVSentinel's own bearer token, and the /oauth2/token client secret"
    )
    site_secret: SecretStr | None = Field(
        default=None,
        description="derives per-job ingest tokens (`trainmedic ingest job-token`) and per-node signing keys; "
        "at least 32 characters",
    )
    ingest_munge: bool = Field(
        default=True,
        description="accept `Authorization: MUNGE` on /v1/nvrx (needs unmunge, the cluster's munged and Slurm access)",
    )
    ingest_munge_socket: str | None = Field(default=None, description="munged's socket; unset: munge's default")
    ingest_allow_shared_token_for_jobs: bool = Field(
        default=False,
        description="RISK: accept the shared ingest token for NVRx job reports (whoever holds it can requeue any job)",
    )

    # -- Slurm (the executor) ----------------------------------------------------------------
    slurm_access: Literal["local", "ssh", "rest"] = "local"
    slurm_ssh_host: str | None = None
    slurm_ssh_port: int = Field(default=22, ge=1, le=65535)
    slurm_ssh_user: str | None = None
    slurm_ssh_key: Path | None = None
    slurm_ssh_known_hosts: Path | None = None
    slurm_ssh_passphrase: SecretStr | None = None
    slurm_ssh_slurm_conf: str | None = None
    slurmrestd_url: str | None = None
    slurmrestd_user: str | None = None
    slurmrestd_token: SecretStr | None = None

    # -- topics (`trainmedic topics create`) ------------------------------------------------
    topic_partitions: int = Field(
        default=DEFAULT_PARTITIONS,
        ge=1,
        description="partitions of every topic, fixed when they are first created; the streams' tables and "
        "job ownership use it, so it must match the topics (4 for topics an earlier trainmedic created)",
    )
    embedded_broker_warn_records: int = Field(
        default=100_000,
        ge=1,
        description="`up` warns (log, health, metrics) when one partition of the embedded broker holds this many "
        "records: it keeps every record, and each fetch of a partition lists all it holds",
    )
    topic_retention_hours: float = Field(
        default=168.0,
        ge=24.0,
        description="retention of the event topics; at least the read-back windows the workers rely on (24 h)",
    )

    # -- audit retention -------------------------------------------------------------------
    audit_raw_ttl_days: int = Field(default=90, ge=0)
    audit_record_ttl_days: int = Field(default=730, ge=0)
    audit_cluster: str | None = Field(default=None, description="ClickHouse cluster for ON CLUSTER / Replicated*")

    @field_validator("cluster")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not CLUSTER_RE.match(value):
            raise ValueError("not a DNS label (lower-case letters, digits and '-', at most 63 characters)")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            _SecretFiles(settings_cls, env_settings, origin="env"),
            env_settings,
            _SecretFiles(settings_cls, _ConfigFile(settings_cls), origin="file"),
            _ConfigFile(settings_cls),
        )

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, config: Path | None = None, **flags: Any) -> Settings:
        """The effective settings: `flags` (None values: not given) over env over file over defaults."""
        given = {k: v for k, v in flags.items() if v is not None}
        token = _config_file.set(config_path(config))
        try:
            settings = cls(**given)
        except ValidationError as exc:
            raise SettingsError(_describe(exc)) from None
        except PydanticSettingsError as exc:  # a complex value (node_map) that is not JSON in the env
            raise SettingsError(f'{exc} (a mapping is JSON in the environment: \'{{"k8s-name": "gpu01"}}\')') from None
        finally:
            _config_file.reset(token)
        # Whatever this process prints, logs or serves from now on is masked of these (schemas/masking.py).
        remember(*(settings.secret(name) for name in secret_fields()))
        return settings

    def slurm_node(self, name: str | None = None) -> str:
        """The Slurm NodeName this process reports for: `name`, else the node setting, else the
        host name; then node_map, else node_strip_domain. One that is not a Slurm node name
        (schemas.ids) is refused here, as a producer or agent starts: SettingsError saying where
        it came from."""
        import socket

        found = name or self.node or socket.gethostname()
        if found in self.node_map:
            slurm, source = self.node_map[found], f"node_map[{found!r}]"
        else:
            slurm = found.split(".", 1)[0] if self.node_strip_domain else found
            source = "--node / the node setting (TRAINMEDIC_NODE)" if name or self.node else "this host's name"
        try:
            return check_node_name(slurm)
        except NodeNameError as exc:
            raise SettingsError(f"{exc}; it came from {source}: set the node name with --node or node_map") from None

    def secret(self, name: str) -> str | None:
        value = getattr(self, name)
        return value.get_secret_value() if isinstance(value, SecretStr) else value


def config_path(explicit: Path | None) -> Path | None:
    if explicit is not None:
        return explicit
    env = os.environ.get(CONFIG_ENV, "").strip()
    if env:
        return Path(env)
    return SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else None


def secret_file(name: str, config: Path | None = None) -> Path | None:
    """The file a secret setting is read from (TRAINMEDIC_<NAME>_FILE, else `<name>_file` in the
    config file), for readers that re-read it (a rotated token needs no restart); None if none."""
    ref = os.environ.get(f"{ENV_PREFIX}{name.upper()}_FILE", "").strip()
    if ref:
        return Path(ref)
    token = _config_file.set(config_path(config))
    try:
        ref = _ConfigFile(Settings).file_refs().get(f"{name}_file", "")
    finally:
        _config_file.reset(token)
    return Path(ref) if ref else None


def secret_fields() -> list[str]:
    return [name for name, f in Settings.model_fields.items() if _is_secret(f)]


def _is_secret(field: FieldInfo) -> bool:
    return "SecretStr" in str(field.annotation)


class _ConfigFile(PydanticBaseSettingsSource):
    """The YAML config file, read with the project's bounded loader; unknown keys are refused."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self.path = _config_file.get()
        self._values = self._read()

    def _read(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            text = self.path.read_bytes()
        except OSError as exc:
            raise SettingsError(f"config file {self.path}: {exc.strerror or exc}") from None
        data = load_yaml(text, origin=str(self.path))
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise SettingsError(f"config file {self.path}: expected a mapping of setting: value")
        known = set(Settings.model_fields) | {f"{name}_file" for name in secret_fields()}
        unknown = sorted(str(k) for k in data if str(k) not in known)
        if unknown:
            raise SettingsError(f"config file {self.path}: unknown setting(s) {', '.join(unknown)}")
        return {str(k): v for k, v in data.items()}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self._values.items() if k in Settings.model_fields}

    def file_refs(self) -> dict[str, str]:
        return {k: str(v) for k, v in self._values.items() if k.endswith("_file")}


class _SecretFiles(PydanticBaseSettingsSource):
    """Secrets read from files named by ``TRAINMEDIC_<NAME>_FILE`` (env) or ``<name>_file`` (config)."""

    def __init__(self, settings_cls: type[BaseSettings], beside: PydanticBaseSettingsSource, origin: str) -> None:
        super().__init__(settings_cls)
        self.origin = origin
        self._beside = beside
        self.paths = self._paths()

    def _paths(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for name in secret_fields():
            if self.origin == "env":
                ref = os.environ.get(f"{ENV_PREFIX}{name.upper()}_FILE", "").strip()
            else:
                assert isinstance(self._beside, _ConfigFile)
                ref = self._beside.file_refs().get(f"{name}_file", "")
            if ref:
                out[name] = Path(ref)
        return out

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, path in self.paths.items():
            try:
                values[name] = path.read_text().strip()
            except OSError as exc:
                label = f"{ENV_PREFIX}{name.upper()}_FILE" if self.origin == "env" else f"{name}_file"
                raise SettingsError(f"{label}={path}: cannot read the secret: {exc.strerror or exc}") from None
        return values


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "?"
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"setting {name} ({ENV_PREFIX}{name.upper()}): {msg}")
    return "; ".join(parts)


# -- provenance: what `trainmedic config show` prints -------------------------------------------


def provenance(config: Path | None = None, **flags: Any) -> list[tuple[str, str, str]]:
    """(name, value as shown, origin) of every setting; secrets masked."""
    settings = Settings.load(config, **flags)
    given = {k for k, v in flags.items() if v is not None}
    path = config_path(config)
    token = _config_file.set(path)
    try:
        file_source = _ConfigFile(Settings)
        file_values = file_source()
        file_secrets = _SecretFiles(Settings, file_source, origin="file").paths
    finally:
        _config_file.reset(token)
    env_secrets = {
        name: os.environ[f"{ENV_PREFIX}{name.upper()}_FILE"]
        for name in secret_fields()
        if os.environ.get(f"{ENV_PREFIX}{name.upper()}_FILE", "").strip()
    }
    env = {k.upper() for k in os.environ}
    rows = []
    for name, field in Settings.model_fields.items():
        env_name = f"{ENV_PREFIX}{name.upper()}"
        if name in given:
            origin = "flag"
        elif name in env_secrets:
            origin = f"file named by {env_name}_FILE ({env_secrets[name]})"
        elif env_name in env:
            origin = f"env {env_name}"
        elif name in file_secrets:
            origin = f"file named by {name}_file in {path} ({file_secrets[name]})"
        elif name in file_values:
            origin = f"config file {path}"
        else:
            origin = "default"
        rows.append((name, _shown(getattr(settings, name), _is_secret(field)), origin))
    return rows


def unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """TRAINMEDIC_* variables that name no setting (a typo, or a setting that was removed)."""
    env = os.environ if environ is None else environ
    known = {f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields} | {CONFIG_ENV}
    known |= {f"{ENV_PREFIX}{n.upper()}_FILE" for n in secret_fields()}
    known |= _SCRIPT_ENV
    return sorted(
        k
        for k in env
        if k.upper().startswith(ENV_PREFIX) and k.upper() not in known and not k.upper().startswith(_SCRIPT_PREFIX)
    )


# The 24.11 cluster's scripts (infra/slurm/start-2411.sh) and tests.
_SCRIPT_PREFIX = f"{ENV_PREFIX}SLURM2411_"


# Variables of the local Slurm scripts (infra/slurm) and the test harness, not of trainmedic's processes.
_SCRIPT_ENV = {
    f"{ENV_PREFIX}{name}"
    for name in (
        "SLURM_DIR",
        "SLURM_WAIT",
        "SLURMCTLD_PORT",
        "SLURMD_BASE_PORT",
        "SLURMDBD_PORT",
        "SLURMRESTD_PORT",
        "SLURMRESTD_LIFESPAN",
        "SLURMRESTD_TOKEN_DIR",
        "DEBIAN_MIRROR",
        "SLURM_KEEP",
        "OUTAGE_S",
        "RELIABILITY_ROWS",
        "TEST_ARTIFACTS",
        "CH_HOST",
        "CH_USER",
        "CH_PASSWORD",
        "CH_DATABASE",
    )
}


def _shown(value: Any, secret: bool) -> str:
    if value is None:
        return "-"
    if secret:
        return MASK
    return mask(str(value))  # a URL setting (api, slurmrestd_url) may carry credentials too


def audit_layout(settings: Settings) -> LayoutSettings:
    """The audit's retention and replication settings, from the settings model."""
    # Imported here: the streams worker reads these settings and must not import sinks/.
    from sinks.audit_schema import LayoutSettings

    return LayoutSettings(settings.audit_raw_ttl_days, settings.audit_record_ttl_days, settings.audit_cluster)


def clickhouse_dsn(settings: Settings) -> str | None:
    """The ClickHouse URL with the user and password settings in it when the URL has none, and for an
    https URL the ca_bundle setting as its `ca_cert` (unless the URL names one)."""
    url = settings.secret("clickhouse_url")
    if not url or url.startswith("chdb://"):
        return url
    parts = urlsplit(url)
    if parts.scheme == "https" and settings.ca_bundle is not None and "ca_cert=" not in parts.query:
        # clickhouse-connect turns a DSN's query parameters into client arguments: every process that
        # opens the audit from this URL verifies the server against the bundle.
        query = "&".join(q for q in (parts.query, urlencode({"ca_cert": str(settings.ca_bundle)})) if q)
        parts = parts._replace(query=query)
        url = urlunsplit(parts)
    if parts.username or not (settings.clickhouse_user or settings.clickhouse_password):
        return url
    user = quote(settings.clickhouse_user or "default", safe="")
    password = settings.secret("clickhouse_password")
    auth = f"{user}:{quote(password, safe='')}" if password else user
    return urlunsplit(parts._replace(netloc=f"{auth}@{parts.netloc}"))


def apply(settings: Settings) -> None:
    """Make `settings` the process's: its cluster name (ids, events), Kafka security and the consumer
    watchdog's thresholds (bus), and its secrets masked in every log record and uncaught exception's
    traceback (schemas/masking.py)."""
    mask_process_output()
    remember(*(settings.secret(name) for name in secret_fields()))
    set_cluster(settings.cluster)
    try:
        configure_security(kafka_security(settings))
    except ValueError as exc:
        raise SettingsError(f"kafka_security_protocol {settings.kafka_security_protocol}: {exc}") from None
    configure_session_timeout(settings.kafka_session_timeout_ms)
    try:
        configure_watchdog(StallSettings(settings.consumer_stall_s, settings.consumer_stall_give_up_s))
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def kafka_security(settings: Settings) -> KafkaSecurity:
    def path(p: Path | None) -> str | None:
        return str(p) if p is not None else None

    return KafkaSecurity(
        protocol=settings.kafka_security_protocol,
        sasl_mechanism=settings.kafka_sasl_mechanism,
        sasl_username=settings.kafka_sasl_username,
        sasl_password=settings.secret("kafka_sasl_password"),
        ssl_ca=path(settings.kafka_ssl_ca),
        ssl_certificate=path(settings.kafka_ssl_certificate),
        ssl_key=path(settings.kafka_ssl_key),
    )
