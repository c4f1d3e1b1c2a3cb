"""The guard's vLLM plugin without vLLM: which rows run which rules (``engine.vllm_plugin.rows``), the per-request
keys and the server's subtree (``settings``, ``activation``), and the replay a trainer reads (``replay``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.backends.vllm.rules import request_args
from engine.errors import ConfigError
from engine.rules.repeat import RepeatThresholds, reference_fire_index
from engine.vllm_plugin import activation
from engine.vllm_plugin.replay import guard_report
from engine.vllm_plugin.rows import row_args
from engine.vllm_plugin.settings import GuardSettings


def params(extra_args=None, **fields):
    base = {"extra_args": extra_args, "ignore_eos": False, "min_tokens": 0, "eos_token_id": 2,
            "all_stop_token_ids": {2}}
    return SimpleNamespace(**{**base, **fields})


@pytest.fixture(autouse=True)
def no_server_guard(monkeypatch):
    for name in ("ENGINE_REPEAT_TERMINATE_JSON", "ENGINE_REPEAT_TERMINATE_FILE",
                 "COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION", "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON",
                 "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON_PATH"):
        monkeypatch.delenv(name, raising=False)
    activation.server_guard.cache_clear()
    yield
    activation.server_guard.cache_clear()


def test_rows_of_the_engines_own_requests_are_never_the_plugins():
    own = request_args([], key="k", eos_id=2, terminal_ids=[2])
    assert row_args(params({**own, "repeat_terminate.max_consecutive_token_repeats": 3}), check=True) is None


def test_min_tokens_gates_the_repeat_guard_and_the_row():
    args = row_args(params({"repeat_terminate.max_consecutive_token_repeats": 3}, min_tokens=5), check=False)
    assert args.min_new == 5 and args.specs[0].params["thresholds"]["min_new_tokens"] == 5


@pytest.mark.parametrize(("extra", "field"), [
    ({"repeat_terminate.ngram_size": 3}, "repeat_terminate.ngram_repeats"),
    ({"repeat_terminate.max_object_keys": 0}, "repeat_terminate.max_object_keys"),
    ({"repeat_terminate.enabled": "yes"}, "repeat_terminate.enabled"),
    ({"min_length.min_chars": 10, "min_length.max_chars": 5}, "min_length.max_chars"),
    ({"min_length.min_char": 10}, "min_length.min_char"),
    ({"repeat_terminat.ngram_size": 3}, "vllm_xargs.repeat_terminat.ngram_size"),
    ({"repeat_terminate": 5}, "repeat_terminate"),
])
def test_bad_settings_are_refused_at_admission_by_name(extra, field):
    with pytest.raises(ConfigError) as err:
        row_args(params(extra), check=True)
    assert err.value.field == field and "Fix:" in str(err.value)


def test_other_extensions_keys_are_left_alone():
    assert row_args(params({"kv_transfer_params": 1, "my_ext.scale": 2.0}), check=True) is None


def test_asking_for_the_guard_with_ignore_eos_is_refused():
    with pytest.raises(ConfigError, match="ignore_eos"):
        row_args(params({"repeat_terminate.max_consecutive_token_repeats": 3}, ignore_eos=True), check=True)


def test_the_server_guard_applies_unless_a_request_turns_it_off(monkeypatch):
    monkeypatch.setenv("COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION", "1")
    monkeypatch.setenv("COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON", '{"enabled": true, "ngram_size": 5, '
                       '"ngram_repeats": 4}')
    activation.server_guard.cache_clear()
    on = row_args(params(None), check=False)
    assert on.specs[0].params["thresholds"]["ngram_size"] == 5
    layered = row_args(params({"repeat_terminate.max_consecutive_token_repeats": 6}), check=False)
    thresholds = layered.specs[0].params["thresholds"]
    assert (thresholds["ngram_size"], thresholds["max_consecutive_token_repeats"]) == (5, 6)
    assert row_args(params({"repeat_terminate.enabled": 0}), check=False) is None
    assert row_args(params(None, ignore_eos=True), check=True) is None  # server-wide: not refused, not run


def test_a_bad_server_guard_names_its_variable(monkeypatch):
    monkeypatch.setenv("ENGINE_REPEAT_TERMINATE_JSON", '{"enabled": true, "ngram_size": 4}')
    with pytest.raises(ConfigError, match=r"from env:ENGINE_REPEAT_TERMINATE_JSON"):
        activation.server_guard()


@pytest.mark.parametrize("tokens", [[5, 6, 5, 6, 5, 6, 2], [3, 3, 3, 3, 2], [1, 2, 3, 4, 5, 6, 7, 8], [4, 4, 2]])
def test_the_replay_finds_the_forced_eos_where_the_rule_fires(tokens):
    guard = {"repeat_terminate.max_consecutive_token_repeats": 3, "repeat_terminate.ngram_size": 2,
             "repeat_terminate.ngram_repeats": 3}
    report = guard_report(tokens, guard, eos_id=2)
    fire = reference_fire_index(tokens, RepeatThresholds(max_consecutive_token_repeats=3, ngram_size=2,
                                                         ngram_repeats=3))
    forced = fire if fire is not None and fire < len(tokens) and tokens[fire] == 2 else None
    assert report["forced_index"] == forced
    assert report["repeat_terminate_triggered"] == int(forced is not None)


def test_min_length_settings_build_the_engines_rule():
    settings = GuardSettings.resolve({"min_length.min_chars": 40, "min_length.max_chars": 90})
    (spec,) = settings.specs()
    assert spec.target == "engine.rules.min_length:MinLengthRule"
    assert (spec.params["min_chars"], spec.params["max_chars"]) == (40, 90)
