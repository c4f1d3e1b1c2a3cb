"""The release gate's teeth: a change seeded at one layer of the pipeline, in a copy of a fixture, is named at that
layer by the comparison of two outputs records, and at no earlier one (``conformance/kit/layers.py``, docs/history.md).

Each copy is recorded through the served twin's own recording path (the one every check records through), on HF:
the comparison rule is backend-neutral, and the changes are to files every backend reads (the tokenizer, the
template, the checkpoint's EOS list, the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.kit.history import compare
from conformance.kit.layers import LAYERS
from conformance.subjects.plan import BUILT, TINY, engines, uses
from conformance.subjects.served import Reach, ServedTwin
from conformance.subjects.variants import answered_token, model_copy
from engine_fixtures import load_prompts

pytestmark = pytest.mark.model_tier(TINY)
SUBJECTS = uses(engines(BUILT, any_config="copies of the tiny fixture, each with one layer changed"))

CHAT = [p["messages"] for p in load_prompts("chat")][:4]
OPTIONS = {"max_new_tokens": 16, "logprobs": 2}
CONFIG = {"checkpoint_eos": True}
"""The engine reads the checkpoint's EOS list when asked (``model.checkpoint_eos``); by default it ignores
``generation_config.json``, and then an extra EOS id there changes nothing (``test_loading.py``)."""


def record(model: Path, check: str) -> list[dict]:
    """HF on ``model``: the calls of this module, recorded as every check records."""
    from engine import GenerationEngine

    reach = Reach()
    reach.record.enabled, reach.record.check = True, check
    engine = GenerationEngine({"backend": "hf", "model": {"path": str(model), "dtype": "float32", **CONFIG}})
    try:
        ServedTwin(engine, None, reach, subject="hf").generate(CHAT, options=OPTIONS)
        return reach.record.rows
    finally:
        engine.close()


def template_whitespace(out: Path, base_rows: list[dict]) -> None:
    template = out / "chat_template.jinja"
    text = template.read_text()
    assert "<|im_end|>' + '\n'" in text
    template.write_text(text.replace("<|im_end|>' + '\n'", "<|im_end|>' + '\n\n'"))


def tokenizer_normalizer(out: Path, base_rows: list[dict]) -> None:
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    assert tokenizer["normalizer"] is None
    tokenizer["normalizer"] = {"type": "Lowercase"}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))


def extra_eos(out: Path, base_rows: list[dict]) -> None:
    from types import SimpleNamespace

    produced = answered_token([SimpleNamespace(token_ids=row["ids"]) for row in base_rows])
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], produced]
    (out / "generation_config.json").write_text(json.dumps(config))


def one_weight(out: Path, base_rows: list[dict]) -> None:
    """The (tied) embedding row of the first token the first answer generates, zeroed: its logit becomes 0."""
    from safetensors.torch import load_file, save_file

    weights_file = out / "model.safetensors"
    weights = load_file(str(weights_file.resolve()))
    weights_file.unlink()  # a symlink to the fixture: write a file of the copy's own
    weights["model.embed_tokens.weight"][base_rows[0]["ids"][0]] = 0.0
    save_file(weights, str(weights_file), metadata={"format": "pt"})


SEEDED = {"template": (template_whitespace, {"template"}), "tokenizer": (tokenizer_normalizer, {"tokenizer"}),
          "ending": (extra_eos, {"ending"}), "weights": (one_weight, {"ids", "logprobs"})}
"""Each seeded change and the layers its changed cases may be named at: the first layer it moves. A weight moves the
model's output, which is the generated ids where a row's greedy token flipped and the log-probabilities where the
change only moved them (such a row keeps its ids); at least one row must flip."""


def test_a_change_seeded_at_each_layer_is_named_at_that_layer(model_path, tmp_path, request):
    """Template whitespace, a tokenizer normalizer, an extra EOS id in ``generation_config.json`` (read with
    ``model.checkpoint_eos``), one changed weight: each copy's record, compared with the fixture's, has changed cases
    and every one of them is named at the seeded layer (the earliest that differs); the fixture against itself is
    equal."""
    check = request.node.nodeid
    base = record(model_path, check)
    again = compare(base, record(model_path, check))
    assert again.counts["equal"] == len(CHAT) and not again.changes, [c.detail for c in again.changes]
    for name, (seed, expected) in SEEDED.items():
        out = model_copy(model_path, tmp_path / name)
        seed(out, base)
        result = compare(base, record(out, check))
        layers = [c.layer for c in result.changes]
        first = min(expected, key=LAYERS.index)
        assert first in layers and set(layers) <= expected, (
            f"seeded at {name}: {result.counts}, named at {layers}: {[c.detail for c in result.changes]}")
