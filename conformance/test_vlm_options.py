"""Vision options that must take effect, not just be accepted: a configured budget that binds, upscaling below
``min_pixels``, ``do_resize: false``, plugins on image requests, and a processor template that reads
``enable_thinking``. Image-token counts are derived by hand from Qwen2-VL's rule (one token per 28 x 28 merged
patch of the resized image), never from the engine.
"""

from __future__ import annotations

import pytest

from conformance.compare import assert_same_results
from conformance.subjects.plan import engines, uses
from conformance.test_vlm import image_tokens, vlm_request
from engine.errors import PluginCompatibilityError, RequestError
from engine.plugins import Plugin

SUBJECTS = uses(engines("vlm"))

OPTS = {"max_new_tokens": 12}


def flat_image(width: int, height: int):
    from PIL import Image

    return Image.new("RGB", (width, height), (120, 30, 200))


def test_a_configured_budget_binds(pool, backend_names):
    """``vision.max_pixels: 50176`` in the engine config: a 300 x 500 image is scaled to 168 x 280 = 6 x 10 merged
    patches = 60 tokens (392 x 224 = 112 at the 100352 per-call override; under the 786432 default it is only
    rounded to 308 x 504 = 11 x 18 = 198), on every backend."""
    image = flat_image(300, 500)
    got = {}
    for b in backend_names:
        configured = pool.engine(b, pool.options.vlm_model, vision={"max_pixels": 50176})
        default = pool.engine(b, pool.options.vlm_model)
        small = configured.generate_vlm([vlm_request(image)], options=OPTS)[0]
        wider = configured.generate_vlm([vlm_request(image)], options=OPTS, pixels={"max_pixels": 100352})[0]
        full = default.generate_vlm([vlm_request(image)], options=OPTS)[0]
        assert [image_tokens(configured, r) for r in (small, wider, full)] == [60, 112, 198], b
        got[b] = [small, wider]
    assert_same_results(got, what="configured pixel budget", dtype=pool.options.dtype)


def test_images_below_min_pixels_are_upscaled(vlm_engines, pool):
    """64 x 64 = 4096 pixels: under the default floor (3136) it rounds to 56 x 56 = 4 tokens; with
    ``min_pixels: 200704`` it is scaled by sqrt(200704 / 4096) = 7 to 448 x 448 = 16 x 16 = 256 tokens."""
    image = flat_image(64, 64)
    got = {}
    for b, e in vlm_engines.items():
        floor = e.generate_vlm([vlm_request(image)], options=OPTS)[0]
        up = e.generate_vlm([vlm_request(image)], options=OPTS, pixels={"min_pixels": 200704})[0]
        assert (image_tokens(e, floor), image_tokens(e, up)) == (4, 256), b
        got[b] = [floor, up]
    assert_same_results(got, what="min_pixels upscaling", dtype=pool.options.dtype)


def test_do_resize_false_takes_grid_images_as_they_are(vlm_engines, count_backend_calls, pool):
    """84 x 56 is on the 28-pixel grid: 3 x 2 = 6 tokens unresized. 64 x 64 is not, and 1120 x 840 is over the
    budget: both are refused with a typed error naming the image before anything is generated (the processor
    would fail mid-batch on the first and silently ignore the budget on the second)."""
    pixels = {"do_resize": False}
    got = {}
    for b, e in vlm_engines.items():
        rows = e.generate_vlm([vlm_request(flat_image(84, 56))], options=OPTS, pixels=pixels)
        assert image_tokens(e, rows[0]) == 6, b
        got[b] = rows
        calls = count_backend_calls(e)
        for index, bad, words in ((1, flat_image(64, 64), "multiples of 28"), (1, flat_image(1120, 840), "budget")):
            with pytest.raises(RequestError, match=words) as info:
                e.generate_vlm([vlm_request(flat_image(84, 56)), vlm_request(bad)], options=OPTS, pixels=pixels)
            assert info.value.field == f"requests[{index}].image" and info.value.value == bad.size, b
        assert calls == [], f"{b}: a refused batch generated tokens"
    assert_same_results(got, what="do_resize false", dtype=pool.options.dtype)


class TextOnlyPlugin(Plugin):
    """A plugin that declares it serves text requests only (for the request-kind rejection on images)."""

    name = "text_only_probe"
    request_kinds = frozenset({"text"})

    def hooks(self, backend):
        return frozenset({"post_decode"})


def test_plugins_on_image_requests(vlm_engines, count_backend_calls, pool):
    """A text-only plugin is refused for image requests before generation; a rule plugin (the ``min_length``
    cap) runs inside image generation and ends rows alike on every backend."""
    requests = [vlm_request(flat_image(84, 56), t) for t in ("Describe the image.", "What colour is it?")]
    plugins = [{"name": "min_length", "min_chars": 1, "max_chars": 12}]
    got = {}
    for b, e in vlm_engines.items():
        calls = count_backend_calls(e)
        with pytest.raises(PluginCompatibilityError, match=r"text_only_probe.*does not support vlm"):
            e.generate_vlm(requests, plugins=[TextOnlyPlugin()])
        assert calls == [], f"{b}: a refused request generated tokens"
        free = e.generate_vlm(requests, options={"max_new_tokens": 24})
        capped = e.generate_vlm(requests, options={"max_new_tokens": 24}, plugins=plugins)
        ended = 0
        for f, c in zip(free, capped, strict=True):
            if c.meta["min_length_capped"]:
                ended += 1
                assert (c.finish_reason, c.stop_reason) == ("stop", "min_length"), b
                assert c.token_ids[:-1] == f.token_ids[: len(c.token_ids) - 1], f"{b}: not the free row's prefix"
                assert c.token_ids[-1] == e.tokenizer.eos_token_id
        assert ended, f"{b}: no image row reached 12 characters; the cap was never exercised"
        got[b] = capped
    assert_same_results(got, what="min_length on image requests", dtype=pool.options.dtype)


USES_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_processor_template_reading_thinking_gets_it_disabled(vlm_engines, pool):
    """A Qwen3-VL-style processor template: the engine renders it with thinking off on every backend, so the
    prompt ends with the empty think block (hand-written below) and the prompts and outputs agree."""
    saved = {b: e.processor.chat_template for b, e in vlm_engines.items()}
    try:
        got = {}
        for b, e in vlm_engines.items():
            e.processor.chat_template = USES_THINKING
            got[b] = e.generate_vlm([vlm_request(flat_image(84, 56))], options=OPTS)
            tail = e.tokenizer.decode(list(got[b][0].prompt_token_ids), skip_special_tokens=False)
            assert tail.endswith("Describe the image.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"), b
            assert got[b][0].meta["chat_template_fallback"] is None, b
    finally:
        for b, e in vlm_engines.items():
            e.processor.chat_template = saved[b]
    assert_same_results(got, what="thinking-reading processor template", dtype=pool.options.dtype)
