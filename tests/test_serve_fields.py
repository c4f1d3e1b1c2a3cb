"""One description per wire field (``engine/serve/shared/fields.py``): every field of every request body the server
takes says once what it is to the engine (an engine field, a neutral value, or read by the surface itself), every
engine field named is one the engine has, and the shared reader sends every generation option a body sets to the
engine by that name. A field added to a body model without its marker, or with an engine name that does not exist,
fails here."""

from __future__ import annotations

import dataclasses
import typing

import pytest

pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")

from pydantic import BaseModel

from engine.config import GenerationOptions, StopPolicy
from engine.errors import RequestError
from engine.serve.app import SURFACES
from engine.serve.openai.bodies import ChatCompletionRequest, CompletionRequest
from engine.serve.rollout.bodies import RequestConfig
from engine.serve.shared.fields import Engine, FieldTable, Neutral, Wire, engine_options, marked, neutral_values

GENERATION = {f.name for f in dataclasses.fields(GenerationOptions)}
STOP = {f.name for f in dataclasses.fields(StopPolicy)}
OTHER_ENGINE_FIELDS = {"json_schema", "prompts", "plugins[0].min_chars", "plugins[0].max_chars"}
"""Engine fields outside the generation options and the stop policy: the schema argument, ``complete``'s prompt
list, Pattern C's ``min_length`` plugin (the first plugin of its call)."""


def models_in(annotation) -> list[type[BaseModel]]:
    """Every body model an annotation holds, inside arrays and unions too."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def every_model() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo = [model for surface in SURFACES for model in surface.BODIES.values()]
    while todo:
        model = todo.pop()
        if model not in seen:
            seen.append(model)
            todo += [m for info in model.model_fields.values() for m in models_in(info.annotation)]
    return seen


MODELS = every_model()


def test_the_surfaces_bodies_are_all_found():
    names = {m.__name__ for m in MODELS}
    assert {"ChatCompletionRequest", "CompletionRequest", "InferRequest", "RequestConfig", "InferItem", "Message",
            "PatternCRequest", "TokenizeRequest", "EngineExtension", "ResponseFormat"} <= names, names


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_body_field_carries_one_marker(model):
    for name, info in model.model_fields.items():
        markers = [m for m in info.metadata if isinstance(m, (Engine, Neutral, Wire))]
        assert len(markers) == 1, f"{model.__name__}.{name}: {markers} (mark it Engine, Neutral or Wire)"


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_engine_name_is_a_field_the_engine_has(model):
    for path, _, mark in marked(model):
        if not isinstance(mark, Engine):
            continue
        section, _, name = mark.name.partition(".")
        known = (section == "generation" and name in GENERATION) or (section == "stop" and name in STOP) or \
            mark.name in OTHER_ENGINE_FIELDS
        assert known, f"{model.__name__}.{path} names {mark.name!r}, which the engine does not have"
        assert not mark.read or section == "generation", f"{path}: only generation options are read by the reader"


REQUIRED = {ChatCompletionRequest: {"model": "m", "messages": []}, CompletionRequest: {"model": "m", "prompt": "x"},
            RequestConfig: {}}


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_every_read_option_reaches_the_engine_by_its_name_and_back(model):
    """Each generation option the shared reader reads comes out under its engine name, and an engine error about it
    names the client's field again: a new option is its one line in the body model."""
    table = FieldTable.of(model)
    values = {"int": 3, "Number": 0.5}
    for path, attr, mark in marked(model):
        if not (isinstance(mark, Engine) and mark.read):
            continue
        info = model.model_fields[attr]
        value = values["Number"] if "float" in str(info.annotation) else values["int"]
        engine_name = mark.name.removeprefix("generation.")
        assert engine_options(model.model_construct(**REQUIRED[model], **{attr: value})) == {engine_name: value}, path
        error = table.sent({path}).rename(RequestError(mark.name, value, "is bad"))
        assert error.field == path


def test_neutral_fields_take_their_neutral_values_and_refuse_others():
    neutral = [(attr, mark) for _, attr, mark in marked(ChatCompletionRequest) if isinstance(mark, Neutral)]
    assert {"frequency_penalty", "presence_penalty", "logit_bias", "tools"} <= {a for a, _ in neutral}
    def chat(**fields):
        return ChatCompletionRequest.model_construct(**REQUIRED[ChatCompletionRequest], **fields)

    for attr, mark in neutral:
        for value in mark.values:
            neutral_values(chat(**{attr: value}))
        with pytest.raises(RequestError) as err:
            neutral_values(chat(**{attr: "changed"}))
        assert err.value.field == attr and "not supported" in str(err.value)
