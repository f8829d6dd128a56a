"""The audit sink: every anomaly, incident, decision, action, result, approval,
mode change, guardrail trip and dead letter lands in ClickHouse (chDB embedded,
or a server by URL).

Inserts are batched; offsets are committed only after the insert succeeded.
The schema is a numbered series of migrations in sinks/ddl/ (package data); applied
versions are recorded in `schema_migrations`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

from confluent_kafka import KafkaError, Message

from bus import health
from bus.consume import group_consumer
from bus.deadletter import make_dead_letter
from schemas.codec import DecodeError, decode
from schemas.errors import Unavailable
from schemas.events import Event
from schemas.extras import require
from schemas.ids import cluster_scoped
from schemas.masking import mask
from schemas.topics import TOPIC_BY_NAME, Topic
from sinks import metrics
from sinks.audit_schema import (
    BY_NAME,
    DEAD_LETTERS_T,
    DECLARED,
    AuditSchemaError,
    LayoutSettings,
    Table,
    check_settings,
)

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

log = logging.getLogger("trainmedic.audit")


def _ddl_dir() -> Path:
    # Read from the installed package, so a wheel works outside the checkout. Migrations are globbed
    # and hashed as files, which a zipped install does not have.
    root = resources.files("sinks.ddl")
    if not isinstance(root, Path):
        raise ImportError(f"sinks.ddl is not installed as files on disk ({root!r}): install trainmedic unzipped")
    return root


DDL_DIR = _ddl_dir()


_Row = Callable[[Any], list[Any]]
# topic name -> (topic, table, row mapping, column list), all from the one declaration per table.
# The topic is the one read (its event type decodes the record): a table may be fed by two.
TABLES: dict[str, tuple[Topic, str, _Row, list[str]]] = {
    topic: (TOPIC_BY_NAME[topic], t.name, t.row, t.column_names) for topic, t in DECLARED.items()
}


# Skip indexes (bloom filters on job, node, incident) also under FINAL, without the
# "exact mode" that re-reads whole sort-key ranges around each matching granule:
# that guards against versions of a row that differ in the filtered column, and the
# audit's versions of an event are identical redeliveries. Measured: a job's
# anomalies FINAL on 10 M rows 0.14-0.22 s with exact mode, 0.018 s without
# (docs/audit.md, "Deduplication"). Servers that lack a setting ignore it
# (clickhouse-connect drops settings the server does not list).
READ_SETTINGS: dict[str, Any] = {"use_skip_indexes_if_final": 1, "use_skip_indexes_if_final_exact_mode": 0}


class AuditStoreError(Unavailable, RuntimeError):
    pass


class ChdbFolderLocked(AuditStoreError):
    """Another process owns the chDB folder (chDB allows one process per folder)."""

    def __init__(self, folder: Path, holder: str) -> None:
        self.folder = folder
        self.holder = holder
        super().__init__(
            f"the chDB folder {folder} is locked by {holder} (a running `trainmedic up`?): "
            "chDB lets one process at a time open a folder"
        )


def chdb_folder(url: str) -> Path | None:
    """The folder of a `chdb://` URL, None for a server URL."""
    if not url.startswith("chdb://"):
        return None
    return Path(url.removeprefix("chdb://").split("?", 1)[0])


def chdb_folder_holder(folder: Path) -> str | None:
    """Who holds a chDB folder: 'PID n' (from its status file) or None when it is free.

    chDB takes an exclusive flock on `status` for as long as the process lives and
    writes the owner's PID into it. Probing the lock first turns chDB's generic
    "Error initializing EmbeddedServer" into a message that names the owner.
    """
    try:
        fd = os.open(folder / "status", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            m = re.search(r"PID: (\d+)", (folder / "status").read_text(errors="replace"))
            return f"PID {m.group(1)}" if m else "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# --- migrations ---------------------------------------------------------------------

MIGRATION_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")
REBUILD_LINE = re.compile(r"^-- rebuild: ([a-z0-9_, ]+)$", re.MULTILINE)
REBUILD_SUFFIX = "__rebuild"

# The ledger itself predates every numbered migration, so it is created outside them.
# ReplacingMergeTree by version: two processes migrating one server at once both
# record a version, and the ledger still holds it once (the DDL is idempotent).
_BOOTSTRAP = (
    "CREATE DATABASE IF NOT EXISTS {db}",
    """CREATE TABLE IF NOT EXISTS {db}.schema_migrations (
    version UInt32,
    name String,
    checksum String,
    applied_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY version""",
)


def split_sql(text: str) -> list[str]:
    """The statements of a SQL script: `;` outside quotes ends one, `--` comments are dropped."""
    statements: list[str] = []
    buf: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            buf.append(ch)
            if ch == "\\" and i + 1 < len(text):
                buf.append(text[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"`":
            quote = ch
            buf.append(ch)
        elif text.startswith("--", i):
            i = text.find("\n", i)
            if i < 0:
                break
            buf.append("\n")
        elif ch == ";":
            statements.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
        i += 1
    statements.append("".join(buf))
    return [body for stmt in statements if (body := "\n".join(x.rstrip() for x in stmt.strip().splitlines()).strip())]


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path
    checksum: str  # sha256 of the file as written, before `{db}` is replaced

    def statements(self, database: str) -> list[str]:
        return split_sql(self.path.read_text().replace("{db}", database))

    def rebuilds(self) -> list[str]:
        """Tables a `-- rebuild: a, b` line asks to bring to their declared layout (sinks/audit_schema.py)."""
        names = [n.strip() for m in REBUILD_LINE.finditer(self.path.read_text()) for n in m.group(1).split(",")]
        if unknown := [n for n in names if n not in BY_NAME]:
            raise AuditStoreError(f"{self.path.name}: rebuild of undeclared table(s) {', '.join(unknown)}")
        return names


def load_migrations(ddl_dir: Path = DDL_DIR) -> list[Migration]:
    """The numbered migrations NNN_name.sql of a folder, in version order."""
    found: dict[int, Migration] = {}
    for path in sorted(ddl_dir.glob("*.sql")):
        m = MIGRATION_NAME.match(path.name)
        if not m:
            raise AuditStoreError(f"{path}: migration files are named NNN_name.sql (lower case, digits, _)")
        version = int(m.group(1))
        if version in found:
            raise AuditStoreError(f"{path}: version {version} is also {found[version].path.name}")
        found[version] = Migration(version, m.group(2), path, hashlib.sha256(path.read_bytes()).hexdigest())
    return [found[v] for v in sorted(found)]


class AuditStore:
    """A ClickHouse client (chDB or server) plus the audit schema. Thread-safe."""

    def __init__(self, url: str, database: str = "trainmedic", layout: LayoutSettings | None = None) -> None:
        if not database.replace("_", "").isalnum():
            raise AuditStoreError(f"database name {database!r}: letters, digits and _ only")
        self.url = url  # may hold the password: messages show `where` instead
        self.database = database
        self._layout = layout  # None: from the environment when migrate() runs (sinks/audit_schema.py)
        folder = chdb_folder(url)
        if folder is not None and (holder := chdb_folder_holder(folder)) and holder != f"PID {os.getpid()}":
            raise ChdbFolderLocked(folder, holder)
        # A chdb:// audit needs chDB as well as the client: clickhouse-connect's own message would
        # name its extra, not trainmedic's.
        if folder is not None:
            require("embedded", f"the audit at {self.where}", only=("clickhouse_connect", "chdb"))
        else:
            require("server", f"the audit at {self.where}", only=("clickhouse_connect",))
        # Imported here: the node image has no ClickHouse client, and its CLI imports this module.
        import clickhouse_connect

        try:
            # clickhouse-connect picks TLS by port (443, 8443) or `secure`, not by the DSN's scheme: an
            # https URL on another port would otherwise be spoken to in plain HTTP.
            secure = urlsplit(url).scheme == "https"
            self.client: Client = clickhouse_connect.get_client(dsn=url, secure=secure)
        except Exception as exc:
            if "already initialized" in str(exc):
                raise AuditStoreError(
                    f"cannot open {self.where}: this process has another chDB folder open, and chDB allows one per "
                    "process"
                ) from None
            # The driver's message may echo the DSN, password and all.
            raise AuditStoreError(mask(f"cannot open ClickHouse at {self.where}: {exc}")) from None
        self._lock = threading.Lock()

    @classmethod
    def embedded(cls, data_dir: Path, database: str = "trainmedic", layout: LayoutSettings | None = None) -> AuditStore:
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(f"chdb://{data_dir.resolve()}", database, layout)

    @property
    def where(self) -> str:
        """The URL as messages, banners and errors show it: its password masked (schemas/masking.py)."""
        return mask(self.url)

    @property
    def is_chdb(self) -> bool:
        return chdb_folder(self.url) is not None

    def layout(self) -> LayoutSettings:
        """The retention/replication settings, checked: AuditStoreError names what is wrong."""
        try:
            # The wiring passes the settings model's (trainmedic.settings.audit_layout); else the defaults.
            settings = self._layout if self._layout is not None else LayoutSettings()
            check_settings(settings)
        except AuditSchemaError as exc:
            raise AuditStoreError(str(exc)) from None
        if settings.cluster and self.is_chdb:
            raise AuditStoreError(
                f"audit cluster {settings.cluster!r} set, but {self.where} is chDB: chDB has no Keeper or "
                "cluster; Replicated tables need a ClickHouse server cluster"
            )
        return settings

    def _command(self, sql: str) -> None:
        with self._lock:
            self.client.command(sql)

    def applied_migrations(self) -> dict[int, dict[str, Any]]:
        """version -> ledger row; empty when the ledger does not exist yet."""
        exists = self.query(
            "SELECT count() AS n FROM system.tables WHERE database = {d:String} AND name = 'schema_migrations'",
            {"d": self.database},
        )[0]["n"]
        if not exists:
            return {}
        rows = self.query("SELECT version, name, checksum, applied_at FROM {db}.schema_migrations FINAL")
        return {int(r["version"]): r for r in rows}

    def migrate(self, ddl_dir: Path = DDL_DIR) -> list[Migration]:
        """Apply the migrations the ledger lacks, in order; return those applied.

        A database made before the ledger existed (001 applied, nothing recorded)
        is brought up to date too: every migration is written to be idempotent
        (IF NOT EXISTS, OR REPLACE), so rerunning 001 there changes nothing.
        """
        migrations = load_migrations(ddl_dir)
        layout = self.layout()
        for stmt in _BOOTSTRAP:
            self._command(stmt.replace("{db}", self.database))
        applied = self.applied_migrations()
        known = {m.version for m in migrations}
        if newer := sorted(v for v in applied if v not in known):
            log.warning("audit database %s has migrations %s that this trainmedic does not know", self.database, newer)
        done: list[Migration] = []
        for m in migrations:
            if m.version in applied:
                if applied[m.version]["checksum"] != m.checksum:
                    # Editing an applied migration does not reapply it: the change belongs in a new file.
                    log.warning("migration %s was edited after it was applied to %s", m.path.name, self.database)
                continue
            for table in m.rebuilds():
                self.rebuild(BY_NAME[table], layout)
            for stmt in m.statements(self.database):
                self._command(stmt)
            self.insert(
                "schema_migrations",
                [[m.version, m.name, m.checksum, datetime.now(tz=UTC)]],
                ["version", "name", "checksum", "applied_at"],
            )
            log.info("audit database %s: applied migration %s", self.database, m.path.name)
            done.append(m)
        self.apply_retention(layout)
        return done

    # --- the declared layout: rebuild a live table, keep TTL in step with settings ---------

    def _columns(self, name: str) -> list[tuple[str, str]]:
        rows = self.query(
            "SELECT name, type FROM system.columns WHERE database = {d:String} AND table = {t:String} ORDER BY position",
            {"d": self.database, "t": name},
        )
        return [(r["name"], r["type"]) for r in rows]

    def _table_info(self, name: str) -> dict[str, Any] | None:
        rows = self.query(
            "SELECT sorting_key, partition_key, engine_full FROM system.tables "
            "WHERE database = {d:String} AND name = {t:String}",
            {"d": self.database, "t": name},
        )
        return rows[0] if rows else None

    def layout_matches(self, table: Table, name: str | None = None) -> bool:
        """Whether a table has the declared columns, types, sort key, partition key and granularity."""
        info = self._table_info(name or table.name)
        return (
            info is not None
            and info["sorting_key"] == ", ".join(table.order_by)
            and info["partition_key"] == f"toYYYYMM({table.time_column})"
            and f"index_granularity = {table.granularity}" in info["engine_full"]
            and self._columns(name or table.name) == [(c.name, c.type) for c in table.columns]
        )

    def _copy_select(self, table: Table, source: str, target: str) -> str:
        """INSERT ... SELECT from a table of the old layout: NULL keys become ''."""
        have = dict(self._columns(source))
        cols, exprs = [], []
        for c in table.columns:
            if c.name not in have:
                continue  # a column the old layout lacked: its DEFAULT
            cols.append(f"`{c.name}`")
            nullable_to_key = c.default == "''" and "Nullable" in have[c.name] and "Nullable" not in c.type
            exprs.append(f"ifNull(`{c.name}`, '')" if nullable_to_key else f"`{c.name}`")
        db = self.database
        return f"INSERT INTO {db}.{target} ({', '.join(cols)}) SELECT {', '.join(exprs)} FROM {db}.{source}"

    def _missing(self, table: Table, layout: LayoutSettings) -> str:
        """WHERE clause for rows (of another table) whose id the table lacks and which its TTL keeps:
        a row the new layout's TTL has expired is dropped by the copy, as a merge would drop it."""
        where = f"{table.id_column} NOT IN (SELECT {table.id_column} FROM {self.database}.{table.name})"
        if (ttl := table.ttl(layout)) is not None:
            where += f" AND {ttl} > now()"
        return where

    def _copy_missing(self, table: Table, source: str, layout: LayoutSettings) -> int:
        """Copy the rows of `source` whose id the table lacks; return how many there were."""
        where = self._missing(table, layout)
        missing = int(self.query(f"SELECT count() AS n FROM {self.database}.{source} WHERE {where}")[0]["n"])
        if missing:
            self._command(f"{self._copy_select(table, source, table.name)} WHERE {where}")
        return missing

    def rebuild(self, table: Table, layout: LayoutSettings) -> bool:
        """Bring a live table to its declared layout; True when it was rebuilt.

        New table beside it, INSERT SELECT, swap (EXCHANGE TABLES: atomic, Atomic
        databases; RENAME where that is refused), then every row the old table
        received meanwhile (a writer still running during the copy) is copied over
        before the old one is dropped. Before the swap, a failure drops the copy and
        leaves the old table serving; after it, the old rows wait under the
        `__rebuild` name and the next run copies them (it checks for that first).
        Idempotent: a table already in the declared layout is left alone.
        """
        name, side = table.name, table.name + REBUILD_SUFFIX
        db = self.database
        if self._table_info(name) is None:
            self._command(table.ddl(db, layout))
            return True
        if self.layout_matches(table):
            if self._table_info(side) is not None and not self.layout_matches(table, side):
                # A swap that was interrupted before its catch-up: finish it.
                self._copy_missing(table, side, layout)
                self._finish(table, side, layout)
            return False
        if extra := sorted(set(dict(self._columns(name))) - set(table.column_names)):
            # Copying only the declared columns would drop these: declare them first.
            raise AuditStoreError(
                f"{db}.{name} has column(s) {', '.join(extra)} that sinks/audit_schema.py does not declare; "
                "declare them before its layout is rebuilt (nothing was changed)"
            )
        self._command(f"DROP TABLE IF EXISTS {db}.{side}")  # a copy left by a run that failed before its swap
        try:
            self._command(table.ddl(db, layout, name=side))
            self._command(self._copy_select(table, name, side))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._command(f"DROP TABLE IF EXISTS {db}.{side}")
            raise AuditStoreError(
                f"rebuild of {db}.{name} failed before the swap; the old table still serves: {exc}"
            ) from exc
        self._swap(name, side)
        log.info("audit: %s.%s swapped to the declared layout; copying rows written during the copy", db, name)
        self._copy_missing(table, side, layout)
        if not self.is_chdb:
            time.sleep(1.0)  # an insert in flight at the swap lands in the old table: let it finish, copy again
            self._copy_missing(table, side, layout)
        self._finish(table, side, layout)
        return True

    def _swap(self, name: str, side: str) -> None:
        db = self.database
        try:
            self._command(f"EXCHANGE TABLES {db}.{name} AND {db}.{side}")
        except Exception as exc:
            # EXCHANGE needs an Atomic database (the default since ClickHouse 20.10; chDB 26.9 too).
            if "Atomic" not in str(exc) and "NOT_IMPLEMENTED" not in str(exc) and "not supported" not in str(exc):
                raise AuditStoreError(f"swap of {db}.{name} failed; the old table still serves: {exc}") from exc
            log.warning("audit: EXCHANGE TABLES refused (%s); falling back to RENAME", exc)
            self._command(f"RENAME TABLE {db}.{name} TO {db}.{name}__old, {db}.{side} TO {db}.{name}")
            self._command(f"RENAME TABLE {db}.{name}__old TO {db}.{side}")

    def _finish(self, table: Table, side: str, layout: LayoutSettings) -> None:
        where = self._missing(table, layout)
        if left := int(self.query(f"SELECT count() AS n FROM {self.database}.{side} WHERE {where}")[0]["n"]):
            raise AuditStoreError(
                f"{self.database}.{side}: {left} row(s) of the old layout are not in {table.name} after the copy; "
                "kept there, rerun migrate"
            )
        absent = f"{table.id_column} NOT IN (SELECT {table.id_column} FROM {self.database}.{table.name})"
        if expired := int(self.query(f"SELECT count() AS n FROM {self.database}.{side} WHERE {absent}")[0]["n"]):
            log.info("audit: %s.%s: %d row(s) past the TTL were not copied", self.database, table.name, expired)
        self._command(f"DROP TABLE IF EXISTS {self.database}.{side}")

    def apply_retention(self, layout: LayoutSettings) -> list[str]:
        """Set each declared-layout table's TTL to the settings; return the tables changed."""
        changed = []
        for table in BY_NAME.values():
            info = self._table_info(table.name)
            if info is None or not self.layout_matches(table):
                continue
            ttl = table.ttl(layout)
            has_ttl = " TTL " in info["engine_full"]
            if ttl is not None and f"TTL {ttl}" not in info["engine_full"]:
                self._command(f"ALTER TABLE {self.database}.{table.name} MODIFY TTL {ttl}")
            elif ttl is None and has_ttl:
                self._command(f"ALTER TABLE {self.database}.{table.name} REMOVE TTL")
            else:
                continue
            changed.append(table.name)
        return changed

    def migration_status(self, ddl_dir: Path = DDL_DIR) -> list[dict[str, Any]]:
        """Every migration known to the code or the database, applied or pending."""
        applied = self.applied_migrations()
        out: list[dict[str, Any]] = []
        for m in load_migrations(ddl_dir):
            row = applied.pop(m.version, None)
            out.append(
                {
                    "version": m.version,
                    "name": m.name,
                    "state": "pending" if row is None else "applied",
                    "applied_at": row["applied_at"] if row else None,
                    "edited_since": bool(row and row["checksum"] != m.checksum),
                }
            )
        for version, row in sorted(applied.items()):
            out.append(
                {
                    "version": version,
                    "name": row["name"],
                    "state": "unknown to this trainmedic",
                    "applied_at": row["applied_at"],
                    "edited_since": False,
                }
            )
        return out

    def insert(self, table: str, rows: Sequence[list[Any]], columns: list[str]) -> None:
        with self._lock:
            self.client.insert(f"{self.database}.{table}", rows, column_names=columns)

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run a query; `{db}` in the SQL names the audit database."""
        with self._lock:
            res = self.client.query(
                sql.replace("{db}", self.database), parameters=parameters or {}, settings=READ_SETTINGS
            )
        return [dict(zip(res.column_names, row, strict=False)) for row in res.result_rows]

    def write_raw(self, sql: str, fmt: str, dest: BinaryIO, parameters: dict[str, Any] | None = None) -> None:
        """Stream a query's result in a ClickHouse output format (CSVWithNames, Parquet, ...) into dest."""
        with self._lock:
            stream = self.client.raw_stream(
                sql.replace("{db}", self.database), parameters=parameters or {}, fmt=fmt, settings=READ_SETTINGS
            )
            for chunk in stream:
                dest.write(chunk)

    def close(self) -> None:
        with self._lock:
            self.client.close()


# --- why an insert failed ----------------------------------------------------------------

# The `reason` label of trainmedic_audit_insert_failures_total, and what /api/health says:
# a fixed set, so an alert or a panel can select on it (docs/metrics.md, "Audit sink").
INSERT_FAILURE_REASONS = ("disk_full", "unavailable", "rejected", "other")

# ClickHouse's own words for a full disk: NOT_ENOUGH_SPACE (243: a reservation or the
# min_free_disk_* threshold refused), or a write that hit ENOSPC / EDQUOT.
_DISK_FULL = re.compile(
    r"NOT_ENOUGH_SPACE|No space left on device|errno:? ?(?:28|122)\b|Disk quota exceeded|not enough (?:free )?space",
    re.IGNORECASE,
)
# ClickHouse names its error in parentheses: "Code: 60. DB::Exception: ... (UNKNOWN_TABLE)".
_CH_ERROR_NAME = re.compile(r"\(([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*)\)")
# The store cannot take writes now, whatever the rows: down, unreachable, read-only, overloaded,
# its coordination lost, or refusing the credentials. Retrying (or fixing the server) helps.
_UNAVAILABLE_ERRORS = frozenset(
    {
        "ABORTED",
        "ACCESS_DENIED",
        "ALL_CONNECTION_TRIES_FAILED",
        "ALL_REPLICAS_ARE_STALE",
        "AUTHENTICATION_FAILED",
        "CANNOT_ALLOCATE_MEMORY",
        "KEEPER_EXCEPTION",
        "MEMORY_LIMIT_EXCEEDED",
        "NETWORK_ERROR",
        "NO_ZOOKEEPER",
        "QUERY_WAS_CANCELLED",
        "READONLY",
        "REPLICA_IS_NOT_IN_QUORUM",
        "REQUIRED_PASSWORD",
        "SERVER_OVERLOADED",
        "SOCKET_TIMEOUT",
        "TABLE_IS_DROPPED",
        "TABLE_IS_READ_ONLY",
        "TIMEOUT_EXCEEDED",
        "TOO_FEW_LIVE_REPLICAS",
        "TOO_MANY_PARTS",
        "TOO_MANY_SIMULTANEOUS_QUERIES",
        "UNKNOWN_STATUS_OF_INSERT",
    }
)
# PEP 249 classes clickhouse-connect raises (by name: the node image has no clickhouse-connect).
_DBAPI_UNAVAILABLE = frozenset({"OperationalError"})
_DBAPI_REJECTED = frozenset({"DatabaseError", "DataError", "IntegrityError", "ProgrammingError", "NotSupportedError"})


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and those it was raised from or during (a driver wraps the socket's error)."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def insert_failure_reason(exc: BaseException) -> str:
    """Why an audit insert failed, one of INSERT_FAILURE_REASONS.

    disk_full: the server's disk (or quota) is full; unavailable: the store does not take writes
    now (unreachable, down, read-only, overloaded, credentials refused); rejected: the server
    answered and refused these rows (a table or column missing or of another type: the schema
    is not what this trainmedic writes, or a value does not fit); other: anything else.
    """
    chain = _chain(exc)
    text = "\n".join(str(e) for e in chain)
    if _DISK_FULL.search(text) or any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain
    ):
        return "disk_full"
    names = set(_CH_ERROR_NAME.findall(text))
    classes = {c.__name__ for e in chain for c in type(e).__mro__}
    if (
        names & _UNAVAILABLE_ERRORS
        or classes & _DBAPI_UNAVAILABLE
        or any(isinstance(e, OSError | Unavailable) for e in chain)  # sockets, timeouts; AuditStoreError
    ):
        return "unavailable"
    if names or classes & _DBAPI_REJECTED:
        return "rejected"
    return "other"


@dataclass(frozen=True)
class InsertFailure:
    """The audit sink's inserts failing now: what /api/health names under `degraded` and what the
    audit's read paths answer with (503), until an insert succeeds again."""

    table: str
    reason: str  # one of INSERT_FAILURE_REASONS
    error: str  # the exception's first line, bounded
    since: float  # wall-clock time of the first failure in a row
    attempts: int
    rows_waiting: int  # the batch being retried; what the broker holds beyond it waits too

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return (
            f"inserts into {self.table} failing since {since} ({self.reason}, {self.attempts} attempt(s)): "
            f"{self.error}; a batch of {self.rows_waiting} row(s) is retried and its offsets stay uncommitted, "
            "so nothing is lost, but the audit lacks every event since"
        )


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The error's first line, at most `limit` characters, keeping ClickHouse's error name (at its end)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(text) <= limit:
        return text
    names = _CH_ERROR_NAME.findall(text)
    tail = f" ({names[-1]})" if names else ""
    return text[: limit - 3 - len(tail)] + "..." + tail


class RecentIds:
    """Event ids inserted lately, per table, so an event is inserted once.

    The sort keys hold time, node or job before the event id, so ReplacingMergeTree (and
    FINAL) collapses only identical versions of an event. A re-derived one is not identical:
    a kernel line read again after a restart is the same event id with a new arrival time,
    and so is every anomaly derived from it. Such a version is dropped here, before insert.
    At start the window's ids are read back from the tables, so a sink restart keeps it.
    """

    def __init__(self, store: AuditStore, window_s: float = 6 * 3600.0, max_per_table: int = 500_000) -> None:
        self.window_s = window_s
        self.max_per_table = max_per_table
        self._ids: dict[str, dict[str, None]] = defaultdict(dict)  # insertion-ordered: oldest first
        self.dropped: dict[str, int] = defaultdict(int)
        for t in DECLARED.values():
            try:
                rows = store.query(
                    f"SELECT {t.id_column} AS id FROM {{db}}.{t.name} "
                    f"WHERE {t.time_column} >= now64(3) - toIntervalSecond({int(window_s)}) "
                    f"ORDER BY {t.time_column} LIMIT {max_per_table}"
                )
            except Exception as exc:  # no table yet, or a store that cannot say: start empty
                log.warning("audit: recent ids of %s not read back (%s): duplicates may be inserted once", t.name, exc)
                continue
            self.remember(t.name, [str(r["id"]) for r in rows])

    def remember(self, table: str, ids: Sequence[str]) -> None:
        seen = self._ids[table]
        for i in ids:
            seen[i] = None
        while len(seen) > self.max_per_table:
            del seen[next(iter(seen))]

    def new_rows(self, table: str, rows: list[list[Any]], id_index: int) -> list[list[Any]]:
        seen, out, batch = self._ids[table], [], set()
        for row in rows:
            key = str(row[id_index])
            if key in seen or key in batch:
                self.dropped[table] += 1
                continue
            batch.add(key)
            out.append(row)
        return out


class AuditSink:
    """Consumer group over the decision topics, batching rows into the audit store."""

    def __init__(
        self,
        bootstrap: str,
        store: AuditStore,
        group: str = "trainmedic-audit",
        batch_max: int = 2000,
        batch_wait_s: float = 0.5,
    ) -> None:
        self.store = store
        self.batch_max = batch_max
        self.batch_wait_s = batch_wait_s
        self._consumer = group_consumer(bootstrap, cluster_scoped(group), "trainmedic-audit", background=True)
        self.stop_event = threading.Event()
        self.inserted: dict[str, int] = defaultdict(int)
        self.undecodable = 0
        self.recent = RecentIds(store)
        self._id_index = {t.name: t.column_names.index(t.id_column) for t in DECLARED.values()}
        # Set while inserts fail, None again once one succeeds (read by the stack's health).
        self.failing: InsertFailure | None = None
        for name in self._id_index:
            # Every series from the start at 0, so increase() sees a table's first failure too.
            metrics.AUDIT_ROWS.labels(table=name)
            for reason in INSERT_FAILURE_REASONS:
                metrics.AUDIT_INSERT_FAILURES.labels(table=name, reason=reason)

    def _rows(self, msgs: list[Message]) -> dict[str, list[list[Any]]]:
        rows: dict[str, list[list[Any]]] = defaultdict(list)
        for msg in msgs:
            topic, table, to_row, _ = TABLES[msg.topic() or ""]
            try:
                event: Event = decode(topic.event_type, msg.value() or b"")
            except DecodeError as exc:
                # Not the event it claims to be: kept as a dead letter, with the reason, instead.
                self.undecodable += 1
                log.error("audit: undecodable %s record at offset %s: %s", msg.topic(), msg.offset(), exc)
                letter = make_dead_letter(
                    "sinks.audit", msg.topic() or "", msg.partition(), msg.offset(), str(exc), msg.value()
                )
                rows["dead_letters"].append(DEAD_LETTERS_T.row(letter))
                continue
            rows[table].append(to_row(event))
        return rows

    def _insert_with_retry(self, rows: dict[str, list[list[Any]]]) -> None:
        delay = 0.5
        while True:
            self._health.beat()
            table = ""
            try:
                for table, table_rows in rows.items():
                    columns = next(cols for _, t, _, cols in TABLES.values() if t == table)
                    fresh = self.recent.new_rows(table, table_rows, self._id_index[table])
                    if fresh:
                        self.store.insert(table, fresh, columns)
                        self.recent.remember(table, [str(r[self._id_index[table]]) for r in fresh])
                        metrics.AUDIT_ROWS.labels(table=table).inc(len(fresh))
                    self.inserted[table] += len(fresh)
                self._health.beat(processed=sum(len(r) for r in rows.values()))
                self._health.set_ready(True, "consuming")
                if self.failing is not None:
                    log.warning(
                        "audit inserts succeed again after %d failed attempt(s) since %s",
                        self.failing.attempts,
                        datetime.fromtimestamp(self.failing.since, tz=UTC).isoformat(timespec="seconds"),
                    )
                    self.failing = None
                return
            except Exception as exc:  # any storage failure: back off and retry, offsets stay uncommitted
                if self.stop_event.is_set():
                    raise
                reason = insert_failure_reason(exc)
                metrics.AUDIT_INSERT_FAILURES.labels(table=table or "unknown", reason=reason).inc()
                before = self.failing
                failure = InsertFailure(
                    table=table or "unknown",
                    reason=reason,
                    error=_first_line(exc),
                    since=time.time(),
                    attempts=1,
                    rows_waiting=sum(len(r) for r in rows.values()),
                )
                self.failing = (
                    failure if before is None else replace(failure, since=before.since, attempts=before.attempts + 1)
                )
                self._health.set_ready(False, f"audit inserts failing ({reason}), retrying: {type(exc).__name__}")
                log.error("audit insert failed, retrying in %.1f s (%s, into %s): %s", delay, reason, table, exc)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def run(self) -> None:
        self._health = health.loop("audit-sink", stale_after_s=120.0)
        self._consumer.subscribe(
            list(TABLES), on_assign=lambda _c, _ps: self._health.set_ready(True, "consuming: partitions assigned")
        )
        try:
            while not self.stop_event.is_set():
                self._health.beat()
                batch: list[Message] = []
                deadline = time.monotonic() + self.batch_wait_s
                while len(batch) < self.batch_max and time.monotonic() < deadline:
                    msgs = self._consumer.consume(num_messages=self.batch_max - len(batch), timeout=0.1)
                    for m in msgs:
                        if (err := m.error()) is not None:
                            if err.code() != KafkaError._PARTITION_EOF:
                                log.warning("audit consumer error: %s", err)
                            continue
                        batch.append(m)
                if not batch:
                    continue
                self._insert_with_retry(self._rows(batch))
                self._consumer.commit(asynchronous=False)
        finally:
            self._health.stop()
            self._consumer.close()
