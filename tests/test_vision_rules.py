"""VLM request validation and the pixel budget (pure; images are tiny synthetic PIL images)."""

from __future__ import annotations

import io

import pytest

from engine.config import EngineConfig, PixelBudget
from engine.errors import ConfigError, RequestError
from engine.vision import VisionRequest

Image = pytest.importorskip("PIL.Image", reason="images need Pillow (installed by `nox -s tests`)")


def req(*parts, role="user"):
    return [{"role": role, "content": list(parts)}]


def img(size=(8, 6), color=(255, 0, 0)):
    return Image.new("RGB", size, color)


def test_one_image_from_pil_path_or_bytes(tmp_path):
    pil = img()
    path = tmp_path / "x.png"
    pil.save(path)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    for value in (pil, str(path), path, buf.getvalue()):
        r = VisionRequest.of(req({"type": "image", "image": value}, {"type": "text", "text": "hi"}), index=0)
        assert r.image.size == (8, 6) and r.image.mode == "RGB"
        assert r.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "hi"}]


def test_grayscale_becomes_rgb():
    r = VisionRequest.of(req({"type": "image", "image": Image.new("L", (4, 4))}), index=0)
    assert r.image.mode == "RGB"


@pytest.mark.parametrize("count", [0, 2, 3])
def test_exactly_one_image(count):
    parts = [{"type": "image", "image": img()}] * count + [{"type": "text", "text": "hi"}]
    with pytest.raises(RequestError) as info:
        VisionRequest.of(req(*parts), index=5)
    assert info.value.field == "requests[5].images" and info.value.value == count


def test_images_are_counted_across_messages():
    two = [*req({"type": "image", "image": img()}), *req({"type": "image", "image": img()}, role="assistant")]
    with pytest.raises(RequestError, match="exactly one image"):
        VisionRequest.of(two, index=0)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (req({"type": "video", "video": "x"}), "requests[0].messages[0].content[0].type"),
        (req({"type": "text", "text": 3}), "requests[0].messages[0].content[0].text"),
        (req({"type": "image", "image": 42}), "requests[0].messages[0].content[0].image"),
        (req({"type": "image", "image": "/no/such/file.png"}), "requests[0].messages[0].content[0].image"),
        (req({"type": "image", "image": b"not an image"}), "requests[0].messages[0].content[0].image"),
        ([], "requests[0].messages"),
    ],
)
def test_bad_parts_name_the_field(raw, field):
    with pytest.raises(RequestError) as info:
        VisionRequest.of(raw, index=0)
    assert info.value.field == field


def test_pixel_budget_kwargs_and_merging():
    budget = PixelBudget()
    assert budget.max_pixels == 786432
    assert budget.as_processor_kwargs() == {"size": {"shortest_edge": 3136, "longest_edge": 786432},
                                            "do_resize": True}
    assert budget.merged({"max_pixels": 50176}).max_pixels == 50176
    with pytest.raises(ConfigError) as info:
        budget.merged({"max_pixels": 1000})
    assert info.value.field == "vision.min_pixels"


def test_engine_config_vision_and_fallback():
    cfg = EngineConfig.from_dict({"backend": "vllm", "model": "/m", "vision": {"max_pixels": 100352},
                                  "fallback_backend": "hf"})
    assert cfg.vision.max_pixels == 100352 and cfg.fallback_backend == "hf"
    with pytest.raises(ConfigError, match="must differ"):
        EngineConfig.from_dict({"backend": "hf", "model": "/m", "fallback_backend": "hf"})
    with pytest.raises(ConfigError, match="did you mean 'vllm'"):
        EngineConfig.from_dict({"backend": "hf", "model": "/m", "fallback_backend": "vlm"})
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "vllm", "model": "/m", "vllm": {"limit_images_per_prompt": 2}})
    assert info.value.field == "vllm.limit_images_per_prompt"
