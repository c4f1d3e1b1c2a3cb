"""Plugins without a model: registry, validation, entry points; property tests of their pure rules."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.plugins import ENTRY_POINT_GROUP, Plugin, available_plugins, create_plugin
from engine.rules.cleanup import cleanup, close_unbalanced
from engine.rules.json_boundary import JsonBoundaryScanner, json_boundary
from engine.rules.min_length import MinLengthRule, min_length_decision

STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def reference_boundary(text: str) -> int | None:
    """Independent spec: the first prefix (from the first bracket) whose brackets outside strings balance."""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return None
    start = min(starts)
    for end in range(start + 1, len(text) + 1):
        if text[end - 1] not in "}]":
            continue
        outside = STRING.sub("", text[start:end])
        if '"' in outside:  # inside an unterminated string: nothing after it counts yet
            continue
        if sum(outside.count(c) for c in "{[") == sum(outside.count(c) for c in "}]"):
            return end
    return None


@given(st.text(alphabet='{}[]"\\ax:, ', max_size=40))
@example('say {"a": "}", "b": [1]} more')
@example('{"unterminated: }')
def test_json_boundary_matches_reference(text):
    assert json_boundary(text) == reference_boundary(text)


@given(st.text(alphabet='{}[]"\\ax:, ', max_size=40), st.integers(1, 6))
def test_json_boundary_is_the_same_fed_in_pieces(text, piece):
    scanner = JsonBoundaryScanner()
    for i in range(0, len(text), piece):
        scanner.feed(text[i : i + piece])
    assert scanner.closed_at == json_boundary(text)


@given(st.integers(0, 500), st.integers(0, 300), st.one_of(st.none(), st.integers(300, 600)),
       st.floats(0, 5, allow_nan=False))
def test_min_length_gate(chars, min_chars, max_chars, bias):
    d = min_length_decision(chars, min_chars=min_chars, max_chars=max_chars, punctuation_bias=bias,
                            sentence_end_ids=(7,))
    if max_chars is not None and chars >= max_chars:
        assert d.force_eos
    else:
        assert not d.force_eos
        assert d.ban_eos == (chars < min_chars)
        assert dict(d.bias) == ({7: bias} if chars >= min_chars and bias else {})


def test_min_length_rule_counts_decoded_characters():
    rule = MinLengthRule(min_chars=5, max_chars=None, punctuation_bias=0.0, sentence_end_ids=())
    rule.push(1, "ab")
    assert rule.decision().ban_eos
    rule.push(2, "cde")
    assert not rule.decision().ban_eos


def test_cleanup_steps():
    assert close_unbalanced('say "hi') == 'say "hi"'
    assert close_unbalanced('{"a": "x}"') == '{"a": "x}"}'
    assert cleanup("  a. b  ") == "a. b"
    assert cleanup("One. Two", sentence_end=True, trim_whitespace=False) == "One."


def test_unknown_plugin_lists_what_exists():
    with pytest.raises(ConfigError) as info:
        create_plugin({"name": "json_boundry"}, index=2)
    assert info.value.field == "plugins[2].name" and "did you mean 'json_boundary'" in str(info.value)
    assert "cleanup" in str(info.value) and "min_length" in str(info.value)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"name": "min_length", "min_chars": -1}, "plugins[0].min_chars"),
        ({"name": "min_length", "min_chars": 50, "max_chars": 10}, "plugins[0].max_chars"),
        ({"name": "min_length", "min_char": 5}, "plugins[0].min_char"),
        ({"name": "cleanup", "sentence_end": "yes"}, "plugins[0].sentence_end"),
        ({"name": "json_boundary", "mechanism": "magic"}, "plugins[0].mechanism"),
        ({"min_chars": 3}, "plugins[0]"),
    ],
)
def test_bad_plugin_parameters_fail_before_anything_loads(spec, field, tmp_path):
    """The config keeps plugins as data; the engine checks them first (the model folder here does not exist, so
    any later step would fail on the path instead), and so does the server's launcher, before binding."""
    import json

    from engine.engine import GenerationEngine
    from engine.serve.launch import parser, served_config

    config = {"backend": "hf", "model": "/nonexistent/model", "plugins": [spec]}
    EngineConfig.from_dict(config)  # data: accepted as written
    with pytest.raises(ConfigError) as info:
        GenerationEngine(config)
    assert info.value.field == field
    path = tmp_path / "engine.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    with pytest.raises(ConfigError) as served:
        served_config(parser().parse_args(["--config", str(path)]), environ={})
    assert served.value.field == field


def test_third_party_plugin_through_the_entry_point_group(monkeypatch):
    module = types.ModuleType("thirdparty_plugin")

    class Shout(Plugin):
        name = "shout"

        def hooks(self, backend):
            return frozenset({"post_decode"})

        def post_decode(self, text):
            return text.upper()

    module.Shout = Shout
    monkeypatch.setitem(sys.modules, "thirdparty_plugin", module)
    ep = importlib.metadata.EntryPoint(name="shout", value="thirdparty_plugin:Shout", group=ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [ep] if kw.get("group") == ENTRY_POINT_GROUP else real(**kw))
    assert available_plugins()["shout"] == "thirdparty_plugin:Shout"
    assert create_plugin({"name": "shout"}, index=0).post_decode("ok") == "OK"
