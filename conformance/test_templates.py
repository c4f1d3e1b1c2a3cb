"""Chat templates: rendered once by the engine with thinking disabled, recorded fallback, same ids everywhere."""

from __future__ import annotations

import pytest

from conformance.subjects.plan import engines, uses
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"))

MSGS = load_prompts("chat")[0]["messages"]


def transformers_ids(tokenizer, text: str) -> list[int]:
    """Token ids of already-rendered text: the template wrote any BOS itself, so none is added here."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]

# A template that refuses the keyword outright (as some strict templates do).
REJECTS_THINKING = (
    "{% if enable_thinking is defined %}{{ raise_exception('enable_thinking is not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Qwen3-style template that reads the keyword: thinking off writes an empty think block.
USES_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture
def with_template(engines):
    """Swap the chat template of every shared engine's tokenizer for one test, then restore it."""
    saved = {b: e.tokenizer.chat_template for b, e in engines.items()}

    def apply(template):
        for e in engines.values():
            e.tokenizer.chat_template = template

    yield apply
    for b, e in engines.items():
        e.tokenizer.chat_template = saved[b]


def test_rejecting_template_falls_back_and_records_it(engines, with_template):
    with_template(REJECTS_THINKING)
    results = {b: e.generate([MSGS], options={"max_new_tokens": 16})[0] for b, e in engines.items()}
    for b, r in results.items():
        assert r.meta["chat_template_fallback"] and "enable_thinking" in r.meta["chat_template_fallback"], b
    first, *others = results.values()
    for other in others:
        assert other.prompt_token_ids == first.prompt_token_ids
        assert other.token_ids == first.token_ids and other.text == first.text


def test_template_using_thinking_gets_it_disabled(engines, with_template):
    with_template(USES_THINKING)
    # Expected prompt written out by hand from the template: thinking off gives the empty think block.
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MSGS)
    text += "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    results = {b: e.generate([MSGS], options={"max_new_tokens": 16})[0] for b, e in engines.items()}
    for b, r in results.items():
        assert r.meta["chat_template_fallback"] is None, b
        assert list(r.prompt_token_ids) == transformers_ids(engines[b].tokenizer, text), f"{b}: thinking not disabled"
    first, *others = results.values()
    assert all(other.token_ids == first.token_ids for other in others)


def test_default_template_renders_once_without_double_bos(engine):
    """Reference: transformers' own ``apply_chat_template`` text, tokenized without added specials."""
    r = engine.generate([MSGS], options={"max_new_tokens": 4})[0]
    text = engine.tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert list(r.prompt_token_ids) == transformers_ids(engine.tokenizer, text)
    assert r.meta["chat_template_fallback"] is None
    bos = engine.tokenizer.bos_token_id
    if bos is not None:
        assert list(r.prompt_token_ids).count(bos) == text.count(engine.tokenizer.bos_token), "double BOS"
