"""The one YAML loader of the project: bounded in size, depth, aliases and expanded nodes.

A pure parsing helper (no I/O, no project imports), kept on the shared floor so that
producers, streams, sinks and the CLI all load YAML the same way. PyYAML's own
`safe_load` shares the objects an alias points to, so a 3 KB "billion laughs" document
loads quickly - and then explodes in whatever walks the result (validation, error
messages, JSON). Here the composed node graph is measured *before* anything is built:
its expanded size is computed once per node (linear in the document), so a bomb is
refused in milliseconds. Error messages name the line and the problem, never the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from schemas.errors import ConfigError


@dataclass(frozen=True)
class YamlLimits:
    max_bytes: int = 1_000_000
    max_depth: int = 64  # nesting of collections; PyYAML's composer recurses per level
    max_aliases: int = 100  # 0: any alias is refused
    max_nodes: int = 200_000  # scalars + collections after expanding every alias


# Files an operator wrote (policies, catalogs, mode overlays): aliases are fine, bombs are not.
FILE_LIMITS = YamlLimits()
# Bodies of API requests: nobody needs an anchor in a request, so none is accepted.
API_LIMITS = YamlLimits(max_aliases=0)


class YamlError(ConfigError, ValueError):
    """Invalid or over-limit YAML; the message names the origin and line, not the content."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, text: str, limits: YamlLimits, origin: str) -> None:
        super().__init__(text)
        self._limits = limits
        self._origin = origin
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > self._limits.max_aliases:
                mark = self.peek_event().start_mark
                what = (
                    "aliases are not accepted here"
                    if self._limits.max_aliases == 0
                    else f"more than {self._limits.max_aliases} aliases"
                )
                raise YamlError(f"{self._origin}: line {mark.line + 1}: {what}")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > self._limits.max_depth:
            mark = self.peek_event().start_mark
            raise YamlError(f"{self._origin}: line {mark.line + 1}: nested deeper than {self._limits.max_depth} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_size(root: yaml.Node, limit: int, origin: str) -> int:
    """Nodes after alias expansion, computed once per node (iteratively: no recursion limit).

    A node reached again through an alias weighs its whole subtree again, which is what
    a consumer walking the data pays. A cycle (an alias inside its own anchor) is refused.
    """
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            if total > limit:
                raise YamlError(
                    f"{origin}: line {node.start_mark.line + 1}: expands to more than {limit} nodes (an alias bomb?)"
                )
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise YamlError(f"{origin}: line {node.start_mark.line + 1}: an alias refers to its own anchor")
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise YamlError(f"{origin}: line {child.start_mark.line + 1}: an alias refers to its own anchor")
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)]


def _refuse_duplicate_keys(root: yaml.Node, origin: str) -> None:
    """A mapping that names a key twice is refused, naming both lines. PyYAML keeps the last one
    silently: a kill switch set twice would end up as whichever line came last."""
    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, _value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    continue
                line = key.start_mark.line + 1
                ident = (key.tag, key.value)
                if ident in first:
                    shown = key.value if len(key.value) <= 60 else key.value[:57] + "..."
                    raise YamlError(f"{origin}: line {line}: duplicate key {shown!r} (first at line {first[ident]})")
                first[ident] = line
        stack.extend(_children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _describe(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and line, without the snippet of input it would quote."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = "; ".join(str(p) for p in (exc.context, exc.problem) if p) or type(exc).__name__
        return (where + what)[:300]
    return type(exc).__name__


def compose_yaml(text: str | bytes, origin: str = "<yaml>", limits: YamlLimits = FILE_LIMITS) -> yaml.Node | None:
    """The node graph of a single-document YAML text (None when empty), within `limits`."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise YamlError(f"{origin}: {size} bytes, more than the {limits.max_bytes} accepted")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise YamlError(f"{origin}: not UTF-8 (byte {exc.start})") from None
    try:
        # The reader checks the characters as the loader is made: a control character fails here.
        loader = _BoundedLoader(text, limits, origin)
    except yaml.YAMLError as exc:
        raise YamlError(f"{origin}: not valid YAML: {_describe(exc)}") from None
    try:
        root = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise YamlError(f"{origin}: not valid YAML: {_describe(exc)}") from None
    except RecursionError:
        raise YamlError(f"{origin}: nested too deeply") from None
    finally:
        loader.dispose()
    if root is not None:
        _expanded_size(root, limits.max_nodes, origin)
        _refuse_duplicate_keys(root, origin)
    return root


def construct_yaml(root: yaml.Node | None, origin: str = "<yaml>") -> Any:
    """Python data from a graph made by compose_yaml (safe types only)."""
    if root is None:
        return None
    loader = _BoundedLoader("", FILE_LIMITS, origin)
    try:
        return loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise YamlError(f"{origin}: not valid YAML: {_describe(exc)}") from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise plain Python errors for `2020-02-30` or `!!bool x`.
        raise YamlError(f"{origin}: not valid YAML: {type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        loader.dispose()


def load_yaml(text: str | bytes, origin: str = "<yaml>", limits: YamlLimits = FILE_LIMITS) -> Any:
    """yaml.safe_load with limits: the only way the project reads YAML."""
    return construct_yaml(compose_yaml(text, origin, limits), origin)


def line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at `loc` (a validation error's location), or of its deepest existing
    parent: what every config error names."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if str(k.value) == str(part):
                    child = v
                    line = k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line
