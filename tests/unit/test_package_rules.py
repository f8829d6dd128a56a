"""Which package may import which: the table in docs/architecture.md, held against the code.

The flow runs one way (producers -> topics -> streams -> topics -> sinks) over shared floors, and
`trainmedic/` sits on top by role. An import that breaks the table fails here with the file that
made it, so the layout cannot drift away from its documentation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROLES = ("cli", "stack", "web", "ops")

# group -> the other groups it may import (its own group is always allowed).
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "bus": {"schemas"},
    "slurmio": {"schemas"},
    "producers": {"schemas", "bus", "slurmio"},
    # The streams worker reads the one settings model; it never reaches sinks (see below).
    "streams": {"schemas", "bus", "slurmio", "trainmedic"},
    "sinks": {"schemas", "bus", "slurmio"},
    "sim": {"schemas", "bus", "producers", "sinks"},
    "trainmedic": {"schemas", "bus", "sinks"},
    "trainmedic.ops": {"schemas", "bus", "slurmio", "producers", "streams", "sinks", "trainmedic"},
    "trainmedic.web": {"schemas", "bus", "slurmio", "producers", "streams", "sinks", "trainmedic", "trainmedic.ops"},
    "trainmedic.stack": {
        "schemas", "bus", "slurmio", "producers", "streams", "sinks", "sim",
        "trainmedic", "trainmedic.ops", "trainmedic.web",
    },
    "trainmedic.cli": {
        "schemas", "bus", "slurmio", "producers", "streams", "sinks", "sim", "bench",
        "trainmedic", "trainmedic.ops", "trainmedic.web", "trainmedic.stack",
    },
    "bench": {
        "schemas", "bus", "slurmio", "producers", "streams", "sinks", "sim",
        "trainmedic", "trainmedic.ops", "trainmedic.web", "trainmedic.stack",
    },
}  # fmt: skip
TOPS = {"schemas", "bus", "slurmio", "producers", "streams", "sinks", "sim", "trainmedic", "bench"}
# What streams may take from the top of trainmedic/: the settings model, nothing else.
STREAMS_FROM_TRAINMEDIC = {"trainmedic.settings"}


def group_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in TOPS:
        return None
    if parts[0] == "trainmedic" and len(parts) > 1 and parts[1] in ROLES:
        return f"trainmedic.{parts[1]}"
    return parts[0]


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every absolute import in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top_level))
    return found


def product_files() -> list[Path]:
    return [p for top in sorted(TOPS) for p in sorted((REPO / top).rglob("*.py"))]


def test_every_import_follows_the_table() -> None:
    broken = []
    for path in product_files():
        rel = path.relative_to(REPO)
        src = group_of(".".join(rel.with_suffix("").parts))
        assert src in ALLOWED, f"{rel}: no row for group {src} in the table"
        for module, _ in imports_of(path):
            dst = group_of(module)
            if dst is None or dst == src:
                continue
            if dst not in ALLOWED[src]:
                broken.append(f"{rel} imports {module} ({src} may not import {dst})")
            elif src == "streams" and dst == "trainmedic" and module not in STREAMS_FROM_TRAINMEDIC:
                broken.append(f"{rel} imports {module} (streams take only the settings from trainmedic/)")
    assert not broken, "\n".join(broken)


def test_settings_reach_sinks_only_inside_a_function() -> None:
    """streams/ imports the settings; settings must not pull sinks/ into the streams worker when loaded."""
    eager = [m for m, top in imports_of(REPO / "trainmedic" / "settings.py") if top and group_of(m) == "sinks"]
    assert eager == []


def test_at_most_a_dozen_modules_at_the_top_of_trainmedic() -> None:
    top = sorted(p.name for p in (REPO / "trainmedic").glob("*.py"))
    assert len(top) <= 12, top


def test_the_table_in_the_docs_is_this_table() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `([\w/]+?)/?` \| [^|]* \| ([^|]*) \|$", doc, flags=re.M))
    documented = {
        group.replace("/", "."): {g.strip("` ").replace("/", ".") for g in may.split(",") if g.strip() not in ("", "-")}
        for group, may in rows.items()
    }
    assert documented == ALLOWED
