"""Vision-language path on the tiny Qwen2-VL: pixel-budget parity, the one-image rule, fail-fast and fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.subjects.plan import BUILT, engines, kept, uses
from conformance.subjects.variants import model_copy
from engine.errors import RequestError, UnsupportedCapabilityError
from engine_fixtures.data.images import IMAGE_SIZES, make_image

SUBJECTS = uses(engines("text"), engines("vlm"), engines(BUILT), kept("vllm-text-only-with-fallback"))

BUDGETS = (786432, 100352, 50176)  # the original runtime's, a mid one, one that downscales every image
# Measured independently (PLATFORM.md): 300x500 gives grid [1, 28, 16] -> 112 tokens at 100352, [1, 20, 12] -> 60
KNOWN_COUNTS = {(100352, "gradient-300x500"): 112, (50176, "gradient-300x500"): 60}
OPTS = {"max_new_tokens": 12}
MERGED_PATCH = 28  # patch 14 x merge 2: one image token per 28 x 28 pixels


def vlm_request(image, text="Describe the image."):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def images():
    return {name: make_image(name) for name in IMAGE_SIZES}


@pytest.fixture(scope="session")
def vlm_engine(pool, backend):
    from conformance.kit.availability import unavailable_reason

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    return pool.engine(backend, pool.options.vlm_model)


def image_tokens(engine, result):
    return list(result.prompt_token_ids).count(engine.processor.image_token_id)


def test_pixel_budget_parity(vlm_engines, images):
    names = list(vlm_engines)
    requests = [vlm_request(img) for img in images.values()]  # different sizes in one batch
    counts = {}
    for budget in BUDGETS:
        outs = {b: e.generate_vlm(requests, options=OPTS, pixels={"max_pixels": budget})
                for b, e in vlm_engines.items()}
        for i, label in enumerate(images):
            r0, r1 = outs[names[0]][i], outs[names[1]][i]
            where = f"budget {budget}, image {label}"
            assert r0.prompt_token_ids == r1.prompt_token_ids, f"{where}: prompt ids differ"
            assert r0.token_ids == r1.token_ids, f"{where}: greedy outputs differ"
            n = image_tokens(vlm_engines[names[0]], r0)
            assert n * MERGED_PATCH * MERGED_PATCH <= budget, f"{where}: {n} image tokens exceed the budget"
            counts[(budget, label)] = n
    for label in images:
        per_budget = [counts[(b, label)] for b in BUDGETS]
        assert per_budget == sorted(per_budget, reverse=True), f"{label}: a smaller budget gave more tokens"
    assert counts[(BUDGETS[0], "stripes-1024x768")] > counts[(BUDGETS[-1], "stripes-1024x768")], "no downscaling"
    for key, n in KNOWN_COUNTS.items():
        assert counts[key] == n, f"{key}: {counts[key]} image tokens, expected {n}"
    print("image tokens per (budget, image):", counts)


def test_config_budget_equals_call_budget(vlm_engines, images):
    """The configured budget (default 786432) and the same budget given per call agree on every backend."""
    request = [vlm_request(images["gradient-300x500"])]
    for b, e in vlm_engines.items():
        default = e.generate_vlm(request, options=OPTS)[0]
        explicit = e.generate_vlm(request, options=OPTS, pixels={"max_pixels": 786432})[0]
        assert default.prompt_token_ids == explicit.prompt_token_ids and default.token_ids == explicit.token_ids, b


@pytest.fixture
def counted_vlm(vlm_engine, count_backend_calls):
    return vlm_engine, count_backend_calls(vlm_engine)


@pytest.mark.parametrize("count", [0, 2])
def test_one_image_rule(counted_vlm, images, count):
    engine, calls = counted_vlm
    img = images["tiny-64x64"]
    bad = [{"role": "user", "content": [*([{"type": "image", "image": img}] * count), {"type": "text", "text": "Hi"}]}]
    with pytest.raises(RequestError) as info:
        engine.generate_vlm([vlm_request(img), bad])
    assert info.value.field == "requests[1].images" and info.value.value == count
    assert calls == [], "nothing may be generated for a batch with a bad request"


def test_image_as_path_and_bytes(vlm_engine, images, tmp_path):
    import io

    img = images["checker-640x480"]
    path = tmp_path / "checker.png"
    img.save(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    outs = vlm_engine.generate_vlm([vlm_request(img), vlm_request(str(path)), vlm_request(buf.getvalue())],
                                   options=OPTS)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def test_vlm_results_keep_the_text_contract(vlm_engine, images):
    tok = vlm_engine.tokenizer
    requests = [vlm_request(img) for img in images.values()]
    free = vlm_engine.generate_vlm(requests, options=OPTS)
    for r in free:
        assert r.raw_text == tok.decode(list(r.token_ids), skip_special_tokens=False)
        assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
    # A stop string that occurs in the first output: cut there, reported, raw_text untouched.
    stop = free[0].text[2:4]
    assert stop.strip(), f"first output too short to derive a stop string: {free[0].text!r}"
    stopped = vlm_engine.generate_vlm(requests[:1], options=OPTS, stop={"strings": [stop]})[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free[0].text[: free[0].text.index(stop)]
    assert stop in stopped.raw_text


def test_text_only_model_under_vllm_fails_fast(pool, backend_names, images):
    engine = pool.engine("vllm", pool.options.model)
    assert engine.backend.capabilities.supports_vlm is False
    with pytest.raises(UnsupportedCapabilityError, match=r"supports_vlm is False.*fallback_backend"):
        engine.generate_vlm([vlm_request(images["tiny-64x64"])])


@pytest.fixture(scope="session")
def text_only_vllm_on_vlm(pool, backend_names):
    """vLLM started text-only on the VLM checkpoint (no image slots), with an HF fallback configured."""
    from engine import GenerationEngine

    cfg = pool.config("vllm", pool.options.vlm_model)
    cfg["vllm"] = {**cfg["vllm"], "limit_images_per_prompt": 0}
    cfg["fallback_backend"] = "hf"
    return pool.keep(("vllm-text-only-with-fallback", pool.options.vlm_model), lambda: GenerationEngine(cfg))


def test_fallback_is_explicit_lazy_and_recorded(text_only_vllm_on_vlm, vlm_engines, images, caplog):
    engine = text_only_vllm_on_vlm
    assert engine.backend.capabilities.supports_vlm is False
    assert engine._fallback is None, "the fallback loads lazily, on first need"
    requests = [vlm_request(images["gradient-300x500"])]
    with caplog.at_level("WARNING", logger="engine.engine"):
        got = engine.generate_vlm(requests, options=OPTS)[0]
    assert got.meta["backend"] == "hf"
    assert got.meta["fallback"]["from"] == "vllm" and got.meta["fallback"]["to"] == "hf"
    assert "supports_vlm is False" in got.meta["fallback"]["reason"]
    assert any("fall back" in rec.getMessage() for rec in caplog.records), "the fallback must be logged"
    want = vlm_engines["hf"].generate_vlm(requests, options=OPTS)[0]
    assert got.token_ids == want.token_ids
    text = engine.generate([[{"role": "user", "content": "Hello"}]], options=OPTS)[0]
    assert text.meta["backend"] == "vllm" and text.meta["fallback"] is None, "text requests stay on vLLM"


@pytest.fixture(scope="session")
def vlm_without_pad(pool, tmp_path_factory):
    return str(model_copy(Path(pool.options.vlm_model), tmp_path_factory.mktemp("vlm-variant") / "no-pad",
                          drop_pad=True))


def test_vlm_pad_fallback_and_left_padding(pool, vlm_engine, backend, vlm_without_pad, images):
    variant = pool.engine(backend, vlm_without_pad)
    assert variant.tokenizer.pad_token_id == variant.tokenizer.eos_token_id
    assert variant.tokenizer.padding_side == "left"
    requests = [vlm_request(img) for img in images.values()]
    got = variant.generate_vlm(requests, options=OPTS)
    want = vlm_engine.generate_vlm(requests, options=OPTS)
    for g, w in zip(got, want, strict=True):
        assert g.meta["pad_token_fallback"] is True
        assert g.token_ids == w.token_ids and g.prompt_token_ids == w.prompt_token_ids
