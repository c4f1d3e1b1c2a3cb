"""Loading: pad-token fallback and left padding on a tokenizer without a pad token; no checkpoint defaults leak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.subjects.plan import BUILT, TINY, engines, uses
from conformance.subjects.variants import answered_token, model_copy
from engine_fixtures import load_prompts

# A tokenizer without a pad token and a poisoned generation_config.json against the same model without them: the rows
# must be equal whatever the model says, so the tiny tier's payload model proves it (its copy and loads are cheap).
pytestmark = pytest.mark.model_tier(TINY)
SUBJECTS = uses(engines(TINY), engines(BUILT))

CHAT = [p["messages"] for p in load_prompts("chat")]

# Defaults a checkpoint might ship; none may reach generation. ``variant_model`` adds an ``eos_token_id`` list whose
# second id is a token the greedy answers really produce (vllm#4180 class: vLLM merges that list into its stop ids).
POISONED_GENERATION_CONFIG = {"do_sample": True, "temperature": 1.7, "top_k": 3, "top_p": 0.5,
                              "repetition_penalty": 1.9, "max_new_tokens": 2, "max_length": 5}
BUDGET = {"max_new_tokens": 24}


@pytest.fixture(scope="module")
def variant_model(pool, model_path, tmp_path_factory):
    """The module's model's variant (and its GGUF twin's, for llamacpp, registered in the pool as its twin)."""
    reference = pool.reference(pool.options.backends[0], str(model_path))
    produced = answered_token(reference.generate(CHAT, options=BUDGET))
    poisoned = {**POISONED_GENERATION_CONFIG, "eos_token_id": [reference.tokenizer.eos_token_id, produced]}
    root = tmp_path_factory.mktemp("variant")
    out = model_copy(model_path, root / "no-pad-poisoned", generation_config=poisoned, drop_pad=True)
    twin = dict(pool.twins).get(str(model_path))
    if twin is not None:
        pool.twins[str(out)] = str(model_copy(Path(twin), root / "no-pad-poisoned-gguf", generation_config=poisoned,
                                              drop_pad=True))
    return out


def test_a_gguf_whose_vocabulary_differs_from_the_tokenizer_is_refused_at_load(pool, backend_names, model_path,
                                                                              tmp_path):
    """llama.cpp reads the engine's token ids: a tokenizer whose ids mean other tokens than the GGUF's must fail at
    load, naming the first differing token (two ordinary tokens swapped here)."""
    if "llamacpp" not in backend_names:
        pytest.skip("needs the llamacpp backend in --engine-backends")
    from engine import GenerationEngine
    from engine.errors import ConfigError

    twin = Path(pool.model_for("llamacpp", str(model_path)))
    out = model_copy(twin, tmp_path / "swapped")
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="token 1000") as info:
        GenerationEngine({"backend": "llamacpp", "model": {"path": str(out), "dtype": pool.options.dtype}})
    assert info.value.field == "model.path" and "in the GGUF" in str(info.value)


def test_pad_fallback_left_padding_and_no_leaked_defaults(pool, backend, engine, variant_model):
    """No pad token: EOS pads, left padding. The checkpoint's generation_config.json (sampling defaults, a 2-token
    budget, an EOS list with a token the answers produce) changes nothing: the rows equal the clean model's."""
    variant = pool.engine(backend, str(variant_model))
    assert variant.tokenizer.pad_token_id == variant.tokenizer.eos_token_id
    assert variant.tokenizer.padding_side == "left"
    got = variant.generate(CHAT, options=BUDGET)
    want = engine.generate(CHAT, options=BUDGET)
    listed = json.loads((variant_model / "generation_config.json").read_text())["eos_token_id"][1]
    assert any(listed in w.token_ids[:-1] for w in want), "the listed EOS id must occur inside a clean answer"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.meta["pad_token_fallback"] is True and w.meta["pad_token_fallback"] is False
        assert g.token_ids == w.token_ids, (f"request {i}: variant (no pad, poisoned defaults) differs"
                                            + (" (the checkpoint's EOS list ended it)" if g.token_ids[-1:] == (listed,)
                                               else ""))
    assert max(len(r.token_ids) for r in got) > 2, "a leaked max_new_tokens=2 would have cut every row"
