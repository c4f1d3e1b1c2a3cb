"""Smoke: every backend loads every fixture model and generates greedily; SmolLM2 parity holds."""

from __future__ import annotations

import pytest

from conformance.compare import describe
from fixtures import fixture_path, load_prompts

GREEDY = {"max_new_tokens": 16}


@pytest.mark.parametrize("fixture", ["smollm2-135m-instruct", "tiny-looper"])
def test_backend_loads_text_fixture_and_generates(pool, backend, fixture):
    from conformance.conftest import unavailable_reason

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    eng = pool.engine(backend, str(fixture_path(fixture)))
    results = eng.generate([p["messages"] for p in load_prompts("chat")[:2]], options=GREEDY)
    assert len(results) == 2
    for r in results:
        assert 1 <= len(r.token_ids) <= 16
        assert r.finish_reason in ("stop", "length")
        assert r.meta["backend"] == backend


def test_smollm2_greedy_parity_at_least_5_of_6(engines, pool):
    prompts = load_prompts("chat")
    assert len(prompts) == 6
    names = list(engines)
    outs = {b: engines[b].generate([p["messages"] for p in prompts], options={"max_new_tokens": 64})
            for b in names}
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[names[0]], outs[names[1]], strict=True))
    detail = describe(outs[names[0]], outs[names[1]], name_0=names[0], name_1=names[1],
                      labels=[p["id"] for p in prompts], tokenizer=engines[names[0]].tokenizer)
    print(f"smollm2 greedy parity: {same}/{len(prompts)} prompts identical")
    assert same >= 5, "\n".join(detail)


@pytest.fixture(scope="session")
def vlm_inputs(pool):
    """The tiny Qwen2-VL prompt on one 300x500 image, rendered by its processor (compat active sans torchvision)."""
    from engine.compat import torchvision as tv_compat

    tv_compat.install()
    from transformers import AutoProcessor

    from fixtures.data.images import make_image

    processor = AutoProcessor.from_pretrained(pool.options.vlm_model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = make_image("gradient-300x500")
    size = {"shortest_edge": 3136, "longest_edge": 100352}
    batch = processor(text=[text], images=[image], return_tensors="pt", images_kwargs={"size": size})
    return {"text": text, "image": image, "size": size, "batch": batch}


def _vlm_generate(backend, pool, inputs):
    model_path = pool.options.vlm_model
    if backend == "hf":
        import torch
        from transformers import Qwen2VLForConditionalGeneration

        model = pool.keep(("hf-raw", model_path), lambda: Qwen2VLForConditionalGeneration.from_pretrained(
            model_path, dtype=torch.float32).eval())
        with torch.inference_mode():
            out = model.generate(**inputs["batch"], max_new_tokens=8, do_sample=False)
        return inputs["batch"]["input_ids"][0].tolist(), out[0, inputs["batch"]["input_ids"].shape[1]:].tolist()
    from engine.backends.vllm import prepare_environment
    from engine.config import VllmConfig

    prepare_environment(VllmConfig())
    from vllm import LLM, SamplingParams

    llm = pool.keep(("vllm-raw", model_path), lambda: LLM(
        model=model_path, dtype="float32", generation_config="vllm", max_model_len=2048,
        mm_processor_kwargs={"size": inputs["size"]}, limit_mm_per_prompt={"image": 1, "video": 0}))
    out = llm.generate([{"prompt": inputs["text"], "multi_modal_data": {"image": inputs["image"]}}],
                       SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    return list(out.prompt_token_ids), list(out.outputs[0].token_ids)


@pytest.mark.slow
def test_both_backends_run_the_vlm_fixture_on_one_image(pool, backend_names, vlm_inputs):
    runs = {b: _vlm_generate(b, pool, vlm_inputs) for b in backend_names}
    (p0, o0), (p1, o1) = runs.values()
    grid = vlm_inputs["batch"]["image_grid_thw"][0].tolist()
    assert grid == [1, 28, 16]  # 300x500 under a 100352-pixel budget
    image_pad = pool.engine_tokenizer_id(pool.options.vlm_model, "<|image_pad|>")
    assert p0.count(image_pad) == 28 * 16 // 4, "one image token per 2x2 merged patch"
    assert p0 == p1, f"prompt ids differ: {len(p0)} vs {len(p1)} tokens"
    assert len(o0) == 8 and o0 == o1, f"greedy outputs differ: {o0} vs {o1}"
