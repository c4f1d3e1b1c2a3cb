"""Hypothesis fuzzing of everything a user can hand the engine before generation: configs, per-call options,
stop policies, plugin specs, text and image requests.

The property, for every input: it is accepted (and then holds only finite numbers), or it is refused with a
typed ``EngineError`` whose ``field`` names a key the input really has (or a required one it lacks), whose
message starts with that field, and which says how to fix it. Any other exception (``TypeError``,
``AttributeError``, a processor's ``ValueError``) is a bug. Cases per property: ``CASES`` (stated in the
settings below; hypothesis also replays the examples it found failing before).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, GenerationOptions, PixelBudget, RepeatTerminateConfig, StopPolicy
from engine.config.engine_config import HfConfig, ModelConfig, VllmConfig
from engine.errors import EngineError
from engine.plugins import create_plugin
from engine.types import ChatRequest
from engine.vision import VisionRequest

CASES = 400

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 3), st.text(max_size=6),
    st.sampled_from(["hf", "vllm", "auto", "float32", "cpu", "cuda:0", "eager", "json_boundary", "min_length",
                     "cleanup", "auto", "logits_processor", "stopping_criteria", ""]),
    st.lists(st.one_of(st.integers(-2, 50), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)



def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` three times in four, anything otherwise (``one_of`` would flatten JUNK's many branches and
    draw junk most of the time)."""
    return st.integers(0, 3).flatmap(lambda i: JUNK if i == 0 else valid)


SECTIONS = {"generation": GenerationOptions, "stop": StopPolicy, "hf": HfConfig, "vllm": VllmConfig,
            "vision": PixelBudget, "repeat_terminate": RepeatTerminateConfig, "model": ModelConfig}


WORDS = st.sampled_from(["/m", "auto", "x", "float16", "sdpa"])
BY_NAME = {  # fields whose valid values are a few words: mostly those, sometimes a near miss
    "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16", "fp16"]),
    "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1", "cuda:x", "tpu"]),
    "attn_implementation": st.sampled_from([None, "eager", "sdpa"]),
    "mechanism": st.sampled_from(["auto", "logits_processor", "stopping_criteria", "regex"]),
    "punctuation_bias": st.floats(-1, 2), "min_chars": st.integers(-2, 300), "max_chars": st.integers(-2, 300),
}


def plausible(hint: Any, name: str = "") -> st.SearchStrategy[Any]:
    """Values of the field's own type in a small range (so cross-field checks get reached), by its type hint."""
    if name in BY_NAME:
        return BY_NAME[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return st.one_of(st.none(), *(plausible(a) for a in inner))
    if typing.get_origin(hint) is tuple:
        return st.lists(st.one_of(st.integers(0, 100), st.text(min_size=1, max_size=3)), max_size=3)
    return {bool: st.booleans(), int: st.integers(0, 100), float: st.floats(0, 2), str: WORDS}.get(hint, JUNK)


def section(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """Mappings of a config section: its own keys (a misspelt one now and then) with values of the right type
    three times in four, anything otherwise."""
    hints = typing.get_type_hints(cls)
    keys = [f.name for f in dataclasses.fields(cls)]

    @st.composite
    def draw_section(draw: st.DrawFn) -> dict[str, Any]:
        out = {}
        for key in draw(st.lists(st.sampled_from(keys), unique=True, max_size=4)):
            out[key] = draw(mostly(plausible(hints[key], key)))
        if draw(st.integers(0, 9)) == 0:
            out[draw(st.sampled_from(keys))[:-1] or "x"] = draw(JUNK)
        return out

    return draw_section()


PLUGIN_PARAMS = {"json_boundary": ["mechanism"], "cleanup": ["trim_whitespace", "close_brackets", "sentence_end"],
                 "min_length": ["min_chars", "max_chars", "punctuation_bias"], "nope": ["max_object_keys"]}


def plugin_spec(name: str) -> st.SearchStrategy[dict[str, Any]]:
    params = {p: mostly(BY_NAME.get(p, st.booleans())) for p in PLUGIN_PARAMS[name]}
    return st.fixed_dictionaries({"name": st.just(name)}, optional=params)


PLUGIN_SPEC = mostly(st.one_of(*(plugin_spec(n) for n in PLUGIN_PARAMS)))


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = {"backend": draw(st.sampled_from(["hf", "vllm", "hf", "vlm"])),
                            "model": {"path": "/m"}}
    if draw(st.integers(0, 3)) == 0:
        data["model"] = {**draw(section(ModelConfig)), "path": "/m"}
    for name in draw(st.sets(st.sampled_from([s for s in SECTIONS if s != "model"]), max_size=3)):
        data[name] = draw(mostly(section(SECTIONS[name])))
    if draw(st.booleans()):
        data["plugins"] = draw(mostly(st.lists(PLUGIN_SPEC, max_size=3)))
    if draw(st.integers(0, 9)) == 0:
        data[draw(st.sampled_from(["fallback_backend", "genration", "plugin"]))] = draw(JUNK)
    return data


def path_in(data: Any, field: str) -> bool:
    """Whether dotted ``field`` (``a.b[2].c``) leads somewhere in ``data``, or names a key its parent lacks
    (a required or paired key), or a whole-list value it could not parse."""
    node = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        if part.startswith("["):
            index = int(part[1:-1])
            if not isinstance(node, (list, tuple)) or index >= len(node):
                return False
            node = node[index]
        elif isinstance(node, dict):
            if part not in node:
                return True  # a missing key the error asks for (required, or to be set together)
            node = node[part]
        else:
            return False
    return True


def check_refusal(err: EngineError, data: Any) -> None:
    field = getattr(err, "field", None)
    shape = re.sub(r"\[\d+\]", "[i]", field or "-")
    event(f"refused: {type(err).__name__} {shape}")
    if field is None:  # unfielded errors (capabilities) must still say what to do
        assert "fix" in str(err).lower(), err
        return
    assert isinstance(field, str) and field, err
    assert str(err).startswith(field), f"message does not start with the field {field!r}: {err}"
    assert err.fix, f"no fix given: {err}"
    assert path_in(data, field), f"{field!r} names nothing in the input {data!r}: {err}"


def finite_everywhere(obj: Any) -> None:
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            finite_everywhere(getattr(obj, f.name))
    elif isinstance(obj, float):
        assert math.isfinite(obj), f"accepted a non-finite number: {obj}"
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            finite_everywhere(item)


@settings(max_examples=CASES, deadline=None)
@given(configs())
def test_configs_are_accepted_or_refused_with_the_field(data):
    try:
        cfg = EngineConfig.from_dict(data)
    except EngineError as err:
        check_refusal(err, data)
    else:
        event("accepted")
        finite_everywhere(cfg)


@settings(max_examples=CASES, deadline=None)
@given(*(mostly(section(cls)) for cls in (GenerationOptions, StopPolicy, PixelBudget)))
def test_per_call_overrides_are_accepted_or_refused_with_the_field(options, stop, pixels):
    """The per-call path: ``generate(options=..., stop=..., pixels=...)`` merges into the configured values."""
    for base, overrides, name in ((GenerationOptions(), options, "generation"), (StopPolicy(), stop, "stop"),
                                  (PixelBudget(), pixels, "vision")):
        try:
            merged = base.merged(overrides)
        except EngineError as err:
            check_refusal(err, {name: overrides})
        else:
            event(f"accepted: {name}")
            finite_everywhere(merged)


@settings(max_examples=CASES, deadline=None)
@given(st.lists(PLUGIN_SPEC, min_size=1, max_size=3))
def test_plugin_specs_are_accepted_or_refused_with_the_field(specs):
    for i, spec in enumerate(specs):
        try:
            create_plugin(spec, index=i)
            event("accepted")
        except EngineError as err:
            check_refusal(err, {"plugins": specs})


ROLE = st.sampled_from(["user", "user", "assistant", "system", "tool", "bot", None])
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": mostly(st.text(max_size=5))})
IMAGE_PART = st.fixed_dictionaries({"type": st.just("image"),
                                    "image": mostly(st.one_of(st.just("tiny"), st.binary(max_size=8)))})
PART = mostly(st.one_of(TEXT_PART, IMAGE_PART, st.fixed_dictionaries({"type": JUNK})))
CONTENT = mostly(st.one_of(st.text(max_size=5), st.lists(PART, min_size=1, max_size=3)))
MESSAGE = mostly(st.fixed_dictionaries({"role": ROLE}, optional={"content": CONTENT}))
REQUEST = mostly(st.lists(MESSAGE, min_size=1, max_size=3))


@settings(max_examples=CASES, deadline=None)
@given(REQUEST, st.integers(0, 5))
def test_requests_are_accepted_or_refused_naming_the_request(raw, index):
    from PIL import Image

    def with_images(value: Any) -> Any:  # "tiny" stands for a real image object
        if value == "tiny":
            return Image.new("RGB", (8, 8))
        if isinstance(value, list):
            return [with_images(v) for v in value]
        if isinstance(value, dict):
            return {k: with_images(v) for k, v in value.items()}
        return value

    for kind in (ChatRequest, VisionRequest):
        try:
            kind.of(with_images(raw), index=index)
            event(f"accepted: {kind.__name__}")
        except EngineError as err:
            assert err.field.startswith(f"requests[{index}]"), err
            where = [None] * index + [{"messages": raw, "images": None, "image": None}]
            check_refusal(err, {"requests": where})
