"""One description per wire field: every field of a request body model carries, beside its type, what it is to the
engine, once. A surface's :class:`FieldTable` (its client fields <-> engine fields, both ways) is built from its body
model, and the shared reader :func:`engine_options` sends every generation option a body sets to the engine by the
name its field carries. A new option is one line in the body model of each surface that takes it.

Three markers, one per field (``tests/test_serve_fields.py`` holds every body field to it):

- :class:`Engine` -- the engine field it sets (``generation.max_new_tokens``, ``stop.token_ids``, ``json_schema``);
  ``read=True`` fields are read by :func:`engine_options`, the others by their surface's parser (a synonym, a rule
  between two fields), but both are renamed back through the table in the engine's errors.
- :class:`Neutral` -- accepted only at a value that changes nothing (OpenAI's ``frequency_penalty: 0``).
- :class:`Wire` -- read by the surface itself: the answer's shape (``stream``, ``echo``), the model's name, the
  messages, a nested object's own fields.

>>> from engine.serve.rollout.bodies import RequestConfig
>>> FieldTable.of(RequestConfig).client_field("generation.max_new_tokens")
'max_tokens'
>>> engine_options(RequestConfig(max_tokens=8, top_k=-1, stream=False))
{'top_k': 0, 'max_new_tokens': 8}
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine.errors import ConfigError, EngineError, RequestError


@dataclass(frozen=True)
class Engine:
    """The field sets engine field ``name``; ``convert`` maps the wire value to the engine's (vLLM's ``top_k: -1``
    is the engine's 0); ``read=False``: the surface's parser reads it (the table still renames it).

    >>> Engine("generation.min_p").name
    'generation.min_p'
    """

    name: str
    read: bool = True
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Neutral:
    """Accepted only at one of ``values`` (or null); any other value is refused by name (:func:`neutral_values`).

    >>> Neutral((0, 0.0)).values
    (0, 0.0)
    """

    values: tuple[Any, ...]


@dataclass(frozen=True)
class Wire:
    """Read by the surface itself; ``why`` says what for.

    >>> Wire("answered as server-sent events").why
    'answered as server-sent events'
    """

    why: str


MARKERS = (Engine, Neutral, Wire)


def marker(info: Any) -> Engine | Neutral | Wire | None:
    """The marker a pydantic ``FieldInfo`` carries (None: none, which the layout test refuses)."""
    found = [m for m in info.metadata if isinstance(m, MARKERS)]
    return found[0] if len(found) == 1 else None


def wire_name(name: str, info: Any) -> str:
    return info.alias or name


def nested_models(annotation: Any) -> list[type]:
    """The pydantic models an annotation holds directly (``X | None``), not inside arrays or maps."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in nested_models(arg)]
    return []


def marked(model: type, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(wire path, attribute name, marker) of every field of ``model`` and of the objects nested in it."""
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        path = prefix + wire_name(name, info)
        yield path, name, marker(info)
        for nested in nested_models(info.annotation):
            yield from marked(nested, f"{path}.")


def engine_options(body: Any) -> dict[str, Any]:
    """The generation options ``body`` (a validated body model) sets through its ``Engine("generation.*")`` fields
    read by the shared reader, by their engine names; absent and null fields set nothing."""
    options = {}
    for name, info in type(body).model_fields.items():
        mark, value = marker(info), getattr(body, name)
        if isinstance(mark, Engine) and mark.read and mark.name.startswith("generation.") and value is not None:
            options[mark.name.removeprefix("generation.")] = mark.convert(value) if mark.convert else value
    return options


def leave_it_out(name: str, allowed: tuple[Any, ...]) -> str:
    """The fix of a refused ``Neutral`` field on OpenAI's surface."""
    return f"leave it out or send {allowed[0]!r}"


def neutral_values(body: Any, where: str = "", fix: Callable[[str, tuple[Any, ...]], str] = leave_it_out) -> None:
    """Refuse a ``Neutral`` field of ``body`` set to anything but its neutral values (``where`` prefixes the name;
    ``fix(name, values)`` says what to send)."""
    for name, info in type(body).model_fields.items():
        mark, value = marker(info), getattr(body, name)
        if not isinstance(mark, Neutral) or value is None:
            continue
        allowed = mark.values
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise RequestError(f"{where}{wire_name(name, info)}", value, "is not supported by this server",
                               fix=fix(name, allowed))


def sent_paths(body: Any, prefix: str = "") -> Iterator[str]:
    """The wire paths a validated body sets (nested objects included)."""
    from pydantic import BaseModel

    for name in body.model_fields_set:
        info = type(body).model_fields[name]
        path = prefix + wire_name(name, info)
        yield path
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            yield from sent_paths(value, f"{path}.")


@dataclass(frozen=True)
class FieldTable:
    """One surface's field names, both ways: a parser reads each client field into the engine field the table
    names, and an engine error about an engine field is renamed back to the field the client sent. Built from the
    surface's body model (:meth:`of`).

    >>> table = FieldTable({"max_tokens": "generation.max_new_tokens", "seed": "generation.seed"})
    >>> [table.client_field(f) for f in ("generation.max_new_tokens", "requests[0].messages[1]",
    ...                                  "generation.min_new_tokens", "plugins[0].name")]
    ['max_tokens', 'messages[1]', 'engine.options.min_new_tokens', 'engine.plugins[0].name']
    >>> table.client_field("repeat_terminate.ngram_size")
    'engine.repeat_terminate.ngram_size'
    >>> FieldTable({"stop_token_ids": "stop.token_ids"}).client_field("stop.token_ids[1]")
    'stop_token_ids[1]'
    """

    fields: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Client field (a dotted path) -> engine field. Several client fields may name one engine field (synonyms);
    errors then name the first."""
    requests: str | None = None
    """The client's name for the engine's request list (``infer_requests``); None: the body is one request, whose
    fields the client sends at the top level (``requests[0].messages`` -> ``messages``)."""
    extension: bool = True
    """Whether the surface takes the ``engine: {options, stop, plugins, repeat_terminate}`` extension field: engine
    fields no client field names are then named inside it (``generation.x`` -> ``engine.options.x``)."""

    @classmethod
    def of(cls, model: type, *, requests: str | None = None, extension: bool | None = None) -> FieldTable:
        """The table of a body model: every ``Engine`` field, nested ones by their dotted path; the extension is
        taken where the model has an ``engine`` field (unless ``extension`` says otherwise)."""
        fields = {path: mark.name for path, _, mark in marked(model) if isinstance(mark, Engine)}
        if extension is None:
            extension = "engine" in model.model_fields  # type: ignore[attr-defined]
        return cls(MappingProxyType(fields), requests=requests, extension=extension)

    def sent(self, paths: set[str]) -> FieldTable:
        """This table without the client fields the body does not hold (``paths``: :func:`sent_paths`): where two
        client fields name one engine field (vLLM's ``min_tokens``, the extension's ``engine.options.min_new_tokens``),
        an error names the one the client sent.

        >>> table = FieldTable({"min_tokens": "generation.min_new_tokens"})
        >>> table.sent({"min_tokens"}).client_field("generation.min_new_tokens")
        'min_tokens'
        >>> table.sent({"engine", "engine.options"}).client_field("generation.min_new_tokens")
        'engine.options.min_new_tokens'
        """
        kept = {client: engine for client, engine in self.fields.items() if client in paths}
        return FieldTable(MappingProxyType(kept), requests=self.requests, extension=self.extension)

    def client_field(self, engine_field: str) -> str:
        """The field as the client sent it."""
        for client, engine in self.fields.items():
            if engine == engine_field:
                return client
            if engine_field.startswith(f"{engine}["):  # an item of a listed field: stop.token_ids[1]
                return client + engine_field.removeprefix(engine)
        if engine_field == "requests" or engine_field.startswith("requests["):
            if self.requests is not None:
                return self.requests + engine_field.removeprefix("requests")
            return engine_field.removeprefix("requests[0].")
        if self.extension and (engine_field in ("plugins", "repeat_terminate")
                               or engine_field.startswith(("plugins[", "repeat_terminate."))):
            return "engine." + engine_field
        if self.extension and engine_field.startswith(("generation.", "stop.")):
            return "engine." + engine_field.replace("generation.", "options.", 1)
        return engine_field

    def rename(self, err: EngineError) -> EngineError:
        """``err`` with its field named as the client sent it (other errors unchanged)."""
        if not isinstance(err, (ConfigError, RequestError)):
            return err
        name = self.client_field(err.field)
        return err if name == err.field else type(err)(name, err.value, err.problem, fix=err.fix)
