"""The bounded YAML loader: alias bombs, deep nesting, oversize text and cycles are refused
before anything walks the data; ordinary documents load as yaml.safe_load loads them."""

from __future__ import annotations

import datetime

import pytest
import yaml

from schemas.yamlsafe import API_LIMITS, FILE_LIMITS, YamlError, YamlLimits, load_yaml
from sinks.guardrails import GuardrailConfigError, parse_guardrails
from streams.policy import DEFAULT_POLICY, PolicyError, parse_policy


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The 'billion laughs' shape: each level lists the previous one `width` times."""
    lines = ["  a0: &a0 [" + ",".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "guardrails:\n" + "\n".join(lines) + "\n"


def test_ordinary_documents_load_like_safe_load() -> None:
    text = DEFAULT_POLICY.read_text()
    assert load_yaml(text) == yaml.safe_load(text)
    small = "base: &b {x: 1}\nother: *b\nwhen: 2020-01-02\n"
    assert load_yaml(small) == {"base": {"x": 1}, "other": {"x": 1}, "when": datetime.date(2020, 1, 2)}
    assert load_yaml("") is None


def test_alias_bomb_is_refused_by_expanded_size_and_names_the_line() -> None:
    bomb = alias_bomb()
    assert len(bomb) < 3000
    with pytest.raises(YamlError, match=r"<f>: line \d+: expands to more than 200000 nodes"):
        load_yaml(bomb, "<f>")


def test_api_input_refuses_any_alias() -> None:
    with pytest.raises(YamlError, match="line 2: aliases are not accepted here"):
        load_yaml("a: &x 1\nb: *x\n", "body", API_LIMITS)


def test_alias_count_limit() -> None:
    text = "a: &x 1\n" + "".join(f"b{i}: *x\n" for i in range(5))
    assert load_yaml(text, limits=YamlLimits(max_aliases=5))["b4"] == 1
    with pytest.raises(YamlError, match="more than 4 aliases"):
        load_yaml(text, limits=YamlLimits(max_aliases=4))


def test_depth_size_and_cycles() -> None:
    with pytest.raises(YamlError, match="nested deeper than 64 levels"):
        load_yaml("[" * 65 + "]" * 65)
    assert load_yaml("[" * 64 + "]" * 64) is not None
    with pytest.raises(YamlError, match="more than the 1000000 accepted"):
        load_yaml("a: " + "x" * FILE_LIMITS.max_bytes)
    with pytest.raises(YamlError, match="refers to its own anchor"):
        load_yaml("a: &x [1, *x]")


def test_errors_do_not_quote_the_input() -> None:
    secret = "s3cr3t-" * 20
    for text in (f"a: [{secret}", f"a: !!python/object:os.system {secret}", f"{secret}: 2020-02-30"):
        with pytest.raises(YamlError) as info:
            load_yaml(text, "f")
        assert secret not in str(info.value), str(info.value)
        assert str(info.value).startswith("f: ")


def test_policy_and_guardrail_parsers_refuse_the_bomb() -> None:
    bomb = DEFAULT_POLICY.read_text() + "\n" + alias_bomb().replace("guardrails:", "bomb:")
    with pytest.raises(PolicyError, match="expands to more than"):
        parse_policy(bomb, "p.yaml")
    with pytest.raises(PolicyError, match="aliases are not accepted here"):
        parse_policy(bomb, "body", API_LIMITS)
    with pytest.raises(GuardrailConfigError, match="expands to more than"):
        parse_guardrails(alias_bomb(), "g.yaml")


def test_a_duplicate_key_is_refused_naming_both_lines() -> None:
    text = "mode: autonomous\nkill_switch: true\nrules:\n  - a: 1\n    b: 2\nkill_switch: false\n"
    with pytest.raises(YamlError, match=r"policy.yaml: line 6: duplicate key 'kill_switch' \(first at line 2\)"):
        load_yaml(text, "policy.yaml")
    with pytest.raises(YamlError, match=r"line 2: duplicate key 'a' \(first at line 1\)"):
        load_yaml("- a: 1\n  a: 3\n")
    # The same key in two mappings, and a merge key, are fine.
    assert load_yaml("x: {a: 1}\ny: {a: 2}\nbase: &b {k: 1}\nz:\n  <<: *b\n  k2: 2\n") == {
        "x": {"a": 1},
        "y": {"a": 2},
        "base": {"k": 1},
        "z": {"k": 1, "k2": 2},
    }
