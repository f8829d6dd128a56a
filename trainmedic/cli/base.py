"""What every `trainmedic` command shares: the Typer app class, errors mapped to exit statuses, plain help.

Every app and sub-app is made with `new_app`, so its Click group is `Group`, which

- turns a `TrainmedicError` raised by any command into one line, ``error: MESSAGE``, on
  stderr and the exit status of its class (schemas/errors.py, docs/cli.md): the one
  place where exit statuses are decided; no traceback for expected errors; the message
  masked of every secret the process knows (schemas/masking.py), whatever raised it;
- shows values in help as TEXT, INTEGER, FLOAT, PATH (or the option's own metavar),
  never as Python annotations: Typer prints ``<bool>``, ``<list[Path]>`` with no
  setting to turn that off.

It also holds the options and helpers of the commands that talk to a running `trainmedic up`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from typer.core import TyperArgument, TyperGroup, TyperOption

from schemas.errors import TrainmedicError, UsageError
from schemas.extras import MissingExtra, extra_of
from schemas.masking import mask
from schemas.printable import printable
from trainmedic.settings import CONFIG_ENV, Settings, unknown_env
from trainmedic.settings import apply as apply_settings
from trainmedic.stack.metrics_server import MetricsServer, parse_address

# Typer's labels (without <>) -> the metavar help shows; an unknown annotation shows as VALUE.
_LABELS = {
    "str": "TEXT",
    "int": "INTEGER",
    "float": "FLOAT",
    "int range": "INTEGER",
    "float range": "FLOAT",
    "path": "PATH",
    "file": "FILE",
    "directory": "DIRECTORY",
    "datetime": "DATETIME",
}


def _plain_label(typer_label: str) -> str:
    label = typer_label.strip("<>")
    while label.startswith("list[") and label.endswith("]"):
        label = label[5:-1]
    if "|" in label:  # choices: keep them, they are the values
        return f"[{label}]"
    return _LABELS.get(label.lower(), "VALUE")


class _PlainOption(TyperOption):
    def display_type(self, ctx: Any) -> str:
        if self.is_flag:
            return ""
        return _plain_label(super().display_type(ctx))


class _PlainArgument(TyperArgument):
    def display_type(self, ctx: Any) -> str:
        return ""  # the argument's name (its metavar) already says what it is


# Typer vendors its own Click (typer._click, private): its context, parameter and command types go unnamed here.
def _plain(params: list[Any]) -> list[Any]:
    for p in params:
        # Typer builds its own parameter objects; switching their class is the one hook for their help.
        if type(p) is TyperOption:
            p.__class__ = _PlainOption
        elif type(p) is TyperArgument:
            p.__class__ = _PlainArgument
            if p.metavar is None and p.name:
                p.metavar = p.name.upper()  # as the help texts name them: PATHS, DECISION_ID
    return params


def fail(exc: TrainmedicError) -> NoReturn:
    """The single mapping of an expected error to the user: one line on stderr, the class's exit status.
    The last line of defence for secrets: whatever the message holds, none of them is printed; and its
    one line stays one, control characters escaped (schemas.printable: an API's detail may quote a value)."""
    typer.secho(f"error: {printable(mask(str(exc)))}", fg=typer.colors.RED, err=True)
    raise typer.Exit(int(exc.exit_code)) from None


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            _plain(cmd.get_params(ctx))
        return cmd

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except TrainmedicError as exc:
            fail(exc)
        except ModuleNotFoundError as exc:
            extra = extra_of(exc.name or "")
            if extra is None:
                raise
            # The node image and `pip install trainmedic` carry the producers only. A command that
            # needs more than the extra of the first module it imports calls schemas.extras.require.
            command = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
            fail(MissingExtra(extra, exc.name or "", command or "this command"))


def new_app(**kwargs: Any) -> typer.Typer:
    """A Typer app (or sub-app) whose commands map errors to exit statuses and show plain help."""
    kwargs.setdefault("add_completion", False)
    kwargs.setdefault("no_args_is_help", True)
    return typer.Typer(cls=Group, **kwargs)


# --- options and helpers of the commands that call the operator API of a running `trainmedic up`

DataDir = Annotated[
    Path,
    typer.Option(
        "--data-dir", help="trainmedic's data folder: runtime.json, api-token, chDB (`up`: var, the demo: var/demo)."
    ),
]
ApiOpt = Annotated[Optional[str], typer.Option("--api", help="Operator API URL (default: from DATA_DIR/runtime.json).")]
OperatorOpt = Annotated[str, typer.Option("--operator", help="Who is doing this (recorded in the audit).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def api(data_dir: Path, url: str | None, method: str, path: str, body: Any = None) -> Any:
    """One call to the operator API; its errors (ClientError subclasses) carry their exit status.

    The token is never a flag (it would show in `ps` and shell history): the settings' `token`
    (TRAINMEDIC_TOKEN, TRAINMEDIC_TOKEN_FILE, the config file), else DATA_DIR/api-token."""
    from trainmedic.cli.client import api_token, api_url, call

    s = settings(api=url)
    return call(api_url(data_dir, s.api), api_token(data_dir, s.secret("token")), method, path, body)


# --- the settings model (trainmedic.settings) as the commands see it

_config: Path | None = None


def use_config(path: Path | None) -> None:
    """The config file of this invocation (`trainmedic --config PATH ...`); applied process-wide."""
    global _config
    _config = path
    apply_settings(Settings.load(path))
    if stray := unknown_env():
        # A misspelt variable would otherwise leave its setting at the default without a word.
        typer.echo(
            f"warning: {', '.join(stray)} {'names' if len(stray) == 1 else 'name'} no setting, ignored "
            "(`trainmedic config show` lists the settings)",
            err=True,
        )
    if path is not None:
        # What this process starts (the streams worker under `up`) reads the same file.
        os.environ[CONFIG_ENV] = str(path.resolve())


def config_file() -> Path | None:
    return _config


def settings(**flags: Any) -> Settings:
    """The effective settings: the command's flags (None: not given) over env over the config file."""
    return Settings.load(_config, **flags)


def print_rows(rows: list[dict[str, Any]], as_json: bool, line: Callable[[dict[str, Any]], str]) -> None:
    """An API listing: JSON as the API gave it, or one line per row, its control characters escaped
    (schemas.printable): a newline in a value cannot forge a row, an ANSI escape cannot recolour one."""
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        typer.echo(printable(line(r)))


def running_api(data_dir: Path, clickhouse: str | None) -> tuple[str, str] | None:
    """URL and token of a running `trainmedic up` in DATA_DIR, or None: then a command opens the audit itself
    (the running process owns the chDB folder, so it must be asked instead)."""
    from trainmedic.cli.client import ClientError, api_token, api_url

    if clickhouse or settings().clickhouse_url or not (data_dir / "runtime.json").exists():
        return None
    try:
        s = settings()
        return api_url(data_dir, s.api), api_token(data_dir, s.secret("token"))
    except ClientError:
        return None


def since_days(text: str) -> float:
    from sinks.audit_queries import parse_since

    try:
        return parse_since(text).total_seconds() / 86400
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--since'") from None


def whoami() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"


def expect(value: str | None, allowed: tuple[str, ...] | frozenset[str], what: str) -> None:
    """Refuse a value outside a fixed vocabulary, naming the option and the choices."""
    if value is not None and value not in allowed:
        raise UsageError(f"{what} {value!r}: expected one of {', '.join(allowed)}")


MetricsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--metrics-address",
        help="HOST:PORT serving /metrics, /healthz and /readyz (unauthenticated, read-only); off: none. "
        "Default: the settings metrics_host:metrics_port (TRAINMEDIC_METRICS_HOST / _PORT), off when no port is set.",
    ),
]


def start_probes(flag: str | None, role: str) -> MetricsServer | None:
    """A long-running command's probe listener (/metrics, /healthz, /readyz), started; None when off.
    Its /metrics has `role`'s families only (trainmedic/stack/metrics_server.py ROLES)."""
    at = parse_address(flag) if flag is not None else None
    if flag is None:
        s = settings()
        at = (s.metrics_host, s.metrics_port) if s.metrics_port else None
    return MetricsServer(*at, roles=(role,)).start() if at is not None else None
