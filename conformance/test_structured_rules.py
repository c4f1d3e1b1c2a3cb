"""Structured outputs together with the row rules, on every backend that constrains (HF: xgrammar as a logits
processor; vLLM: its structured outputs), greedy and sampled.

The grammar is applied before the rules on both (vLLM masks before its logits processors; the HF backend orders
its processors the same way), and the rules never undo the mask (``engine.backends.row_apply.apply_decisions``):
a forced EOS the grammar masked waits until the grammar allows it, and an EOS ban never empties a row whose only
allowed token is EOS. The schemas below leave the model no choice of text, so each expectation is exact: the
guard fires inside the array (its EOS masked there), and min_length wants more characters than the schema allows.
In-process engines only (``.local``): the rollout envelope carries no ``json_schema``.
"""

from __future__ import annotations

import json

import pytest

from conformance.compare import assert_same_results
from conformance.subjects.plan import engines, uses
from engine.backends.registry import SPECS

SUBJECTS = uses(engines("text"))

pytestmark = [pytest.mark.dtype_dependent, pytest.mark.runner_dependent]

CONSTRAINED = tuple(name for name, spec in SPECS.items() if spec.structured_outputs)
"""The backends that can constrain output (hf, vllm, and any registered one that declares it)."""
"""Backends with structured outputs (llama.cpp has none: the engine refuses json_schema there by name)."""
PROMPT = [[{"role": "user", "content": "List zeros as a JSON array."}], [{"role": "user", "content": "Zeros?"}]]
TWELVE_ZEROS = {"type": "array", "items": {"const": 0}, "minItems": 12, "maxItems": 12}
TWO_ZEROS = {"type": "array", "items": {"const": 0}, "minItems": 2, "maxItems": 2}
GUARD = {"enabled": True, "max_consecutive_token_repeats": 3, "ngram_size": 2, "ngram_repeats": 3}
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 11}
MIN_60 = {"name": "min_length", "min_chars": 60}


@pytest.fixture(params=CONSTRAINED)
def constrained(request, pool):
    from conformance.kit.availability import unavailable_reason

    if request.param not in pool.options.backends:
        pytest.skip(f"{request.param} is not selected (--engine-backends)")
    if reason := unavailable_reason(request.param):
        pytest.skip(reason)
    return request.param


def test_backends_without_structured_outputs_refuse_a_schema_by_name(pool, backend_names):
    """llama.cpp constrains nothing: a json_schema there fails before any generation, naming the backend and the
    fix, with the rules on or off (never a silent unconstrained answer)."""
    from engine.errors import UnsupportedCapabilityError

    others = [b for b in backend_names if b not in CONSTRAINED]
    if not others:
        pytest.skip(f"every selected backend constrains ({', '.join(backend_names)})")
    for b in others:
        for sections in ({}, {"repeat_terminate": GUARD}):
            with pytest.raises(UnsupportedCapabilityError, match=rf"backend '{b}' cannot constrain.*Fix: drop"):
                pool.engine(b, pool.options.model, **sections).local.generate(
                    PROMPT, options={"max_new_tokens": 4}, json_schema=TWO_ZEROS)


def expect_exact(results, schema_text, what):
    for i, r in enumerate(results):
        assert r.text == schema_text, f"{what}: row {i} text {r.text!r}, the schema allows only {schema_text!r}"
        assert r.finish_reason == "stop", f"{what}: row {i} ended by {r.finish_reason} ({r.stop_reason})"


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_a_guard_firing_inside_the_schema_waits_for_the_grammar_to_allow_eos(pool, constrained, sampling):
    """``[0,0,...]``: the repeat guard fires on the zeros long before the array may close; the row still ends
    exactly at the closing bracket (never an EOS the grammar masked, never a row left with no token)."""
    b = constrained
    eng = pool.engine(b, pool.options.model, repeat_terminate=GUARD)
    got = eng.local.generate(PROMPT, options={"max_new_tokens": 40, **sampling}, json_schema=TWELVE_ZEROS)
    expect_exact(got, "[" + ",".join(["0"] * 12) + "]", f"{b} guard + schema")
    for i, r in enumerate(got):
        assert r.meta["repeat_terminate_triggered"] == 1, f"{b}: row {i}: the guard never fired, the check is void"
        assert r.meta["repeat_terminate_index"] < len(r.token_ids) - 1, \
            f"{b}: row {i}: the guard fired at the end, not inside the array"


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_min_length_never_bans_the_only_token_the_grammar_allows(pool, constrained, sampling):
    """``[0,0]`` is 5 characters and min_length wants 60: after the bracket EOS is all the grammar allows, so the
    ban steps aside and the row ends there, valid."""
    b = constrained
    got = pool.engine(b, pool.options.model).local.generate(PROMPT, options={"max_new_tokens": 24, **sampling},
                                                            json_schema=TWO_ZEROS, plugins=[MIN_60])
    expect_exact(got, "[0,0]", f"{b} min_length + schema")
    assert all(r.meta["min_length_capped"] is False for r in got)


def test_guarded_and_min_length_constrained_rows_agree_across_backends(pool, backend_names):
    """Greedy, the constrained rows with both rules are the same on HF and vLLM: field by field in float32, by
    vLLM's rule in lower precision (``assert_same_results``)."""
    names = [b for b in backend_names if b in CONSTRAINED]
    if len(names) < 2:
        pytest.skip(f"needs hf and vllm; have {names}")
    guard = {b: pool.engine(b, pool.options.model, repeat_terminate=GUARD).local.generate(
        PROMPT, options={"max_new_tokens": 40}, json_schema=TWELVE_ZEROS) for b in names}
    assert_same_results(guard, what="repeat guard under a schema", dtype=pool.options.dtype)
    floor = {b: pool.engine(b, pool.options.model).local.generate(
        PROMPT, options={"max_new_tokens": 24}, json_schema=TWO_ZEROS, plugins=[MIN_60]) for b in names}
    assert_same_results(floor, what="min_length under a schema", dtype=pool.options.dtype)


def test_sampled_constrained_rows_stay_schema_valid(pool, constrained):
    """An open schema, sampled at temperature 1: every row that ends on EOS parses and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    prompts = [[{"role": "user", "content": f"A city of country number {i}, as JSON."}] for i in range(6)]
    eng = pool.engine(constrained, pool.options.model, repeat_terminate=GUARD)
    rows = eng.local.generate(prompts, options={"max_new_tokens": 48, "temperature": 1.0, "seed": 5},
                        json_schema=schema, plugins=[{"name": "min_length", "min_chars": 20}])
    ended = [r for r in rows if r.finish_reason == "stop"]
    assert ended, f"{constrained}: no sampled row finished within 48 tokens"
    for r in ended:
        jsonschema.validate(json.loads(r.text), schema)
