"""Loading: pad-token fallback and left padding on a tokenizer without a pad token; no checkpoint defaults leak."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fixtures import load_prompts

CHAT = [p["messages"] for p in load_prompts("chat")]

# Defaults a checkpoint might ship; none may reach generation.
POISONED_GENERATION_CONFIG = {"do_sample": True, "temperature": 1.7, "top_k": 3, "top_p": 0.5,
                              "repetition_penalty": 1.9, "max_new_tokens": 2, "max_length": 5}


def poisoned_copy(model_path, out):
    """``model_path`` with its pad token removed and a poisoned generation_config.json (weights symlinked)."""
    out.mkdir()
    for item in model_path.iterdir():
        if item.suffix in (".safetensors", ".gguf"):
            os.symlink(item.resolve(), out / item.name)
        elif item.is_file():
            shutil.copy2(item, out / item.name)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(tok_cfg))
    model_cfg = json.loads((out / "config.json").read_text())
    model_cfg.pop("pad_token_id", None)
    (out / "config.json").write_text(json.dumps(model_cfg))
    (out / "generation_config.json").write_text(json.dumps(POISONED_GENERATION_CONFIG))
    return out


@pytest.fixture(scope="session")
def variant_model(pool, model_path, tmp_path_factory):
    """The text model's variant (and its GGUF twin's, for llamacpp, registered in the pool as the variant's twin)."""
    root = tmp_path_factory.mktemp("variant")
    out = poisoned_copy(model_path, root / "no-pad-poisoned")
    twin = dict(pool.twins).get(str(model_path))
    if twin is not None:
        pool.twins[str(out)] = str(poisoned_copy(Path(twin), root / "no-pad-poisoned-gguf"))
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
    out = tmp_path / "swapped"
    out.mkdir()
    for item in twin.iterdir():
        if item.suffix == ".gguf":
            os.symlink(item.resolve(), out / item.name)
        elif item.is_file():
            shutil.copy2(item, out / item.name)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="token 1000") as info:
        GenerationEngine({"backend": "llamacpp", "model": {"path": str(out), "dtype": pool.options.dtype}})
    assert info.value.field == "model.path" and "in the GGUF" in str(info.value)


def test_pad_fallback_left_padding_and_no_leaked_defaults(pool, backend, engine, variant_model):
    variant = pool.engine(backend, str(variant_model))
    assert variant.tokenizer.pad_token_id == variant.tokenizer.eos_token_id
    assert variant.tokenizer.padding_side == "left"
    opts = {"max_new_tokens": 24}
    got = variant.generate(CHAT, options=opts)
    want = engine.generate(CHAT, options=opts)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.meta["pad_token_fallback"] is True and w.meta["pad_token_fallback"] is False
        assert g.token_ids == w.token_ids, f"request {i}: variant (no pad, poisoned defaults) differs"
    assert max(len(r.token_ids) for r in got) > 2, "a leaked max_new_tokens=2 would have cut every row"
