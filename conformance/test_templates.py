"""Chat templates: rendered once by the engine with thinking disabled, recorded fallback, same ids everywhere."""

from __future__ import annotations

import pytest

from engine.templates import render_prompt
from fixtures import load_prompts

MSGS = load_prompts("chat")[0]["messages"]

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
    first, second = results.values()
    assert first.prompt_token_ids == second.prompt_token_ids
    assert first.token_ids == second.token_ids and first.text == second.text


def test_template_using_thinking_gets_it_disabled(engines, with_template):
    with_template(USES_THINKING)
    rendered = {b: render_prompt(e.tokenizer, MSGS) for b, e in engines.items()}
    for b, r in rendered.items():
        assert r.fallback is None, b
        assert r.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), f"{b}: thinking was not disabled"
    results = {b: e.generate([MSGS], options={"max_new_tokens": 16})[0] for b, e in engines.items()}
    first, second = results.values()
    assert first.prompt_token_ids == second.prompt_token_ids == rendered[next(iter(rendered))].token_ids
    assert first.token_ids == second.token_ids


def test_default_template_renders_once_without_double_bos(engine):
    r = engine.generate([MSGS], options={"max_new_tokens": 4})[0]
    rendered = render_prompt(engine.tokenizer, MSGS)
    assert r.prompt_token_ids == rendered.token_ids
    assert r.meta["chat_template_fallback"] is None
    bos = engine.tokenizer.bos_token_id
    if bos is not None:
        assert list(r.prompt_token_ids).count(bos) == rendered.text.count(engine.tokenizer.bos_token), "double BOS"
