"""The ms-swift rollout plugin's pure parts: where the guard comes from, the rows' bookkeeping, the import hook.

``swift rollout`` itself, with both ways in and both of swift's engines, runs in ``conformance/test_swift_rollout.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine.errors import ConfigError, RequestError
from engine.serve import activation
from engine.swift_rollout import PLUGIN_FILE, SITE_DIR, hook
from engine.swift_rollout.attach import OFF, Guard, Rows

SEED_ON = {activation.SEED_ENABLE: "1", activation.SEED_JSON: json.dumps({"enabled": True, "ngram_size": 3,
                                                                        "ngram_repeats": 2})}


def test_the_seeds_variables_and_ours_give_one_guard():
    seeds = Guard.from_environment(SEED_ON)
    ours = Guard.from_environment({activation.ENV_JSON: SEED_ON[activation.SEED_JSON]})
    assert seeds.config == ours.config and seeds.config.enabled
    assert seeds.specs == ours.specs and seeds.specs[0].target == "engine.rules.repeat:RepeatRule"
    off = Guard.from_environment({activation.SEED_ENABLE: "0"})
    assert not off.config.enabled and off.specs == ()


@pytest.mark.parametrize("environ, field", [
    ({**SEED_ON, activation.ENV_JSON: "{}"}, "ENGINE_REPEAT_TERMINATE_JSON"),
    ({activation.SEED_ENABLE: "1"}, activation.SEED_ENABLE),
    ({activation.SEED_ENABLE: "1", activation.SEED_JSON: '{"enabled": true, "ngram_size": 3}'}, "ngram"),
    ({activation.SEED_ENABLE: "1", activation.SEED_JSON: '{"enabled": true, "max_consecutive_tokens": 4}'},
     "max_consecutive_tokens"),
])
def test_a_bad_environment_is_refused_naming_the_field(environ, field):
    with pytest.raises(ConfigError, match=field) as err:
        Guard.from_environment(environ)
    assert "Fix:" in str(err.value)


def params(n=1, extra=None, stop=None):
    return SimpleNamespace(n=n, extra_args=extra, stop_token_ids=stop)


def test_rows_give_each_request_its_rules_and_keep_other_extra_args():
    guard = Guard.from_environment(SEED_ON)
    rows = Rows(guard.specs, eos=2, terminal=[2, 7])
    first, second = params(extra={"mine": 1}, stop=[9]), params()
    rows.admit("0", first)
    rows.admit("1", second)
    a, b = first.extra_args["engine_rules"], second.extra_args["engine_rules"]
    assert first.extra_args["mine"] == 1 and a["key"] != b["key"]
    assert a["eos"] == 2 and a["terminal"] == [2, 7, 9] and b["terminal"] == [2, 7]
    assert a["specs"] == [s.as_dict() for s in guard.specs]


def test_n_above_one_is_refused_before_anything_is_added():
    rows = Rows(Guard.from_environment(SEED_ON).specs, eos=2, terminal=[2])
    with pytest.raises(RequestError, match=r"request_config\.n"):
        rows.admit("0", params(n=4))
    assert not rows.keys


def response(request_id, tokens):
    return SimpleNamespace(response=SimpleNamespace(id=request_id, usage=SimpleNamespace(completion_tokens=tokens)))


def test_reports_come_from_the_rules_events_within_the_returned_tokens():
    rows = Rows(Guard.from_environment(SEED_ON).specs, eos=2, terminal=[2])
    for rid in ("a", "b", "c"):
        rows.admit(rid, params())
    keys = dict(rows.keys)
    taken = rows.take_keys([response("a", 6), response("b", 5), response("c", 3), RuntimeError("failed row")])
    assert set(taken) == {keys["a"], keys["b"], keys["c"]} and not rows.keys
    # Two workers answer (tensor parallel): the first that knows a key wins. "b" fired past its returned tokens
    # (async scheduling ran the rule one step on): that does not count.
    replies = [{keys["a"]: {"repeat_terminate": ["ngram_repeats", 5]}, keys["b"]: {"repeat_terminate":
                                                                                   ["ngram_repeats", 5]}}, {}]
    rows.file(taken, replies)
    assert rows.report("a") == {"repeat_terminate_triggered": 1, "repeat_terminate_index": 5,
                                "repeat_terminate_reason": "ngram_repeats"}
    assert rows.report("b") == OFF and rows.report("c") == OFF and rows.report("never-seen") == OFF


def test_the_stores_are_bounded():
    rows = Rows((), eos=2, terminal=[2], capacity=3)
    for i in range(10):
        rows.admit(str(i), params())
    assert list(rows.keys) == ["7", "8", "9"]


def test_the_hook_installs_once_right_after_its_target_module_runs(tmp_path, monkeypatch):
    package = tmp_path / "fakeswift"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "grpo.py").write_text("import builtins\nbuiltins.ORDER.append('module ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hook, "TARGET", "fakeswift.grpo")
    order: list[str] = []
    monkeypatch.setattr("builtins.ORDER", order, raising=False)
    monkeypatch.setattr("engine.swift_rollout.attach.install", lambda: order.append("install"))
    try:
        assert hook.arm() is True
        import fakeswift.grpo  # noqa: F401
        assert order == ["module ran", "install"]
        assert not any(isinstance(f, hook._AttachAfterImport) for f in sys.meta_path), "one shot"
        assert hook.arm() is False and order == ["module ran", "install", "install"], "already imported: now"
    finally:
        hook.disarm()
        sys.modules.pop("fakeswift.grpo", None)
        sys.modules.pop("fakeswift", None)


def test_the_command_prints_the_plugin_file_and_the_site_folder():
    run = [sys.executable, "-m", "engine.swift_rollout"]
    assert subprocess.run([*run, "plugin"], capture_output=True, text=True, check=True).stdout.strip() == str(
        PLUGIN_FILE)
    assert subprocess.run([*run, "site"], capture_output=True, text=True, check=True).stdout.strip() == str(SITE_DIR)
    assert subprocess.run(run, capture_output=True, text=True).returncode == 2
