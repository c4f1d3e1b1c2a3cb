"""Plugins on both backends: rejection before generation, min-length, cleanup, identity (rows a plugin ends:
``test_rule_ends.py``)."""

from __future__ import annotations

import pytest

from conformance.subjects.plan import engines, servers, uses
from engine.errors import PluginCompatibilityError
from engine.plugins import Plugin
from engine.plugins.base import HF_STOPPING_CRITERIA
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"), servers("text"))

CHAT = [p["messages"] for p in load_prompts("chat")]
JSON = [p["messages"] for p in load_prompts("json") if p["id"] != "json-30-fruits"]


class VlmOnlyPlugin(Plugin):
    """A plugin that declares it only serves VLM requests (for the request-kind rejection)."""

    name = "vlm_only_probe"
    request_kinds = frozenset({"vlm"})

    def hooks(self, backend):
        return frozenset({"post_decode"})


@pytest.fixture
def counted(engine, count_backend_calls):
    return engine, count_backend_calls(engine)


@pytest.mark.servable
def test_no_plugins_is_identical_to_the_engine_without_the_mechanism(engine):
    base = engine.generate(CHAT, options={"max_new_tokens": 32})
    empty = engine.generate(CHAT, options={"max_new_tokens": 32}, plugins=[])
    assert [(r.token_ids, r.text, r.raw_text) for r in base] == [(r.token_ids, r.text, r.raw_text) for r in empty]
    assert all(r.meta["plugins"] == [] for r in base)


@pytest.mark.servable
def test_incompatible_hook_is_rejected_before_generation(counted, backend, reach):
    engine, calls = counted
    plugins = [{"name": "json_boundary", "mechanism": "stopping_criteria"}]  # HF StoppingCriteria only
    if backend == "hf":
        got = engine.generate(JSON[:1], options={"max_new_tokens": 8}, plugins=plugins)
        assert got[0].token_ids and got[0].meta["plugins"] == ["json_boundary"]
        # Served, the in-process answer compared is the one the in-process variant generated
        # (conformance/subjects/served.py); run alone (-m served), the twin generates it once itself.
        assert calls == [1] if reach == "in-process" else calls in ([], [1])
        return
    with pytest.raises(PluginCompatibilityError) as info:
        engine.generate(JSON[:1], plugins=plugins)
    message = str(info.value)
    assert "json_boundary" in message and HF_STOPPING_CRITERIA in message and f"'{backend}'" in message
    assert calls == [], "nothing may be generated"


def test_request_kind_is_rejected_before_generation(counted):
    engine, calls = counted
    with pytest.raises(PluginCompatibilityError, match=r"vlm_only_probe.*does not support text"):
        engine.generate(CHAT[:1], plugins=[VlmOnlyPlugin()])
    assert calls == []


def test_engine_wide_incompatible_plugin_refuses_before_vllm_starts(pool, backend_names, monkeypatch):
    import vllm

    from engine import GenerationEngine

    def no_start(*args, **kwargs):
        raise AssertionError("vLLM was started although the plugin check must fail first")

    monkeypatch.setattr(vllm, "LLM", no_start)

    plugins = [{"name": "json_boundary", "mechanism": "stopping_criteria"}]
    cfg = pool.config("vllm", pool.options.model, plugins=plugins)
    with pytest.raises(PluginCompatibilityError, match="hf_stopping_criteria"):
        GenerationEngine(cfg)


@pytest.mark.servable
def test_min_length_above_natural_length_reaches_it_identically(engines, workload):
    # 8 rows in both tiers: HF holds a batch of 8 or more in its batched min-length rule
    # (engine.rules.min_length_bank), the other backends hold each request with the rule itself; the tokens must
    # not tell them apart. The quick tier's budget is half the gate's: its short answers still end by themselves
    # inside it, so EOS is still held back (asserted below).
    prompts = (CHAT + JSON)[:8]
    assert len(prompts) == 8, "the fixture prompts no longer give 8 rows"
    budget = {"max_new_tokens": workload.pick(full=128, quick=64)}
    # The first backend's longest natural answer sets the bar (the other backends' natural runs were never read).
    natural = next(iter(engines.values())).generate(prompts, options=budget)
    min_chars = max(len(r.text) for r in natural) + 40
    plugin = [{"name": "min_length", "min_chars": min_chars, "punctuation_bias": 2.0}]
    got = {b: e.generate(prompts, options=budget, plugins=plugin) for b, e in engines.items()}
    for b, results in got.items():
        for i, r in enumerate(results):
            assert r.meta["generated_chars"] >= min_chars or r.finish_reason == "length", f"{b} row {i}"
            assert r.meta["returned_chars"] == len(r.text)
        assert any(r.meta["eos_suppressed"] for r in results), f"{b}: EOS was never held back"
    first, *others = got.values()
    for other in others:
        assert [r.token_ids for r in other] == [r.token_ids for r in first]


@pytest.mark.servable
def test_min_length_below_natural_length_changes_nothing(engines, workload):
    prompts = workload.pick(full=CHAT, quick=CHAT[:3])
    for b, e in engines.items():
        free = e.generate(prompts, options={"max_new_tokens": 64})
        low = e.generate(prompts, options={"max_new_tokens": 64}, plugins=[{"name": "min_length", "min_chars": 1}])
        assert [r.token_ids for r in low] == [r.token_ids for r in free], b
        assert not any(r.meta["eos_suppressed"] for r in low)


@pytest.mark.servable
def test_cleanup_identical_across_backends(engines):
    from engine.rules.cleanup import cleanup

    plugins = [{"name": "cleanup", "sentence_end": True, "close_brackets": True}]
    opts = {"max_new_tokens": 24}
    got = {b: e.generate(CHAT + JSON, options=opts, plugins=plugins) for b, e in engines.items()}
    first, *others = got.values()
    for other in others:
        assert [r.text for r in other] == [r.text for r in first]
    name, eng = next(iter(engines.items()))
    free = eng.generate(CHAT + JSON, options=opts)
    changed = 0
    for r, f in zip(got[name], free, strict=True):
        assert r.text == cleanup(f.text, sentence_end=True, close_brackets=True), "cleanup runs after truncation"
        assert r.raw_text == f.raw_text, "raw_text is never post-processed"
        changed += r.text != f.text
    assert changed > 0, "no output needed cleaning; the check would prove little"
