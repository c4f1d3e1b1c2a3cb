"""Smoke: every backend loads every fixture model and generates greedily; SmolLM2 parity holds."""

from __future__ import annotations

import pytest

from conformance.compare import describe
from conformance.subjects.plan import engines, uses
from engine_fixtures import fixture_path, load_prompts

SUBJECTS = uses(engines("text"), engines("tiny-looper"))

GREEDY = {"max_new_tokens": 16}


@pytest.mark.parametrize("fixture", ["smollm2-135m-instruct", "tiny-looper"])
def test_backend_loads_text_fixture_and_generates(pool, backend, fixture):
    from conformance.kit.availability import unavailable_reason

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    eng = pool.engine(backend, str(fixture_path(fixture)))
    results = eng.generate([p["messages"] for p in load_prompts("chat")[:2]], options=GREEDY)
    assert len(results) == 2
    for r in results:
        assert 1 <= len(r.token_ids) <= 16
        assert r.finish_reason in ("stop", "length")
        assert r.meta["backend"] == backend


@pytest.mark.gate_only(reason=(
    "the same six chat prompts on the same engines (17 s on CI); CI keeps "
    "test_parity.py::test_greedy_parity_on_chat_prompts, which holds them and two lists token-identical on every "
    "backend in float32 (this check's 5-of-6 bar is for lower dtypes, the full gate's bfloat16 pass)"))
def test_smollm2_greedy_parity_at_least_5_of_6(engines, pool):
    prompts = load_prompts("chat")
    assert len(prompts) == 6
    names = list(engines)
    outs = {b: engines[b].generate([p["messages"] for p in prompts], options={"max_new_tokens": 64})
            for b in names}
    for other in names[1:]:
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs[names[0]], outs[other], strict=True))
        detail = describe(outs[names[0]], outs[other], name_0=names[0], name_1=other,
                          labels=[p["id"] for p in prompts], tokenizer=engines[names[0]].tokenizer)
        assert same >= 5, "\n".join(detail)
