"""What the three wire formats share (``/infer/``, ``/v1/chat/completions``, Pattern C ``/chat``): one
:class:`FieldTable` per surface that maps client fields to engine fields and back, the ``engine`` extension field,
stop strings, per-token logprobs, usage and OpenAI's error object. No web framework is imported here.

Each surface's own format lives beside it: ``rollout_wire.py``, ``openai_wire.py``, ``pattern_c_wire.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine.errors import ConfigError, EngineError, RequestError
from engine.types import GenerationResult


@dataclass(frozen=True)
class FieldTable:
    """One surface's field names, both ways: a parser reads each client field into the engine field the table
    names, and an engine error about an engine field is renamed back to the field the client sent.

    >>> table = FieldTable({"max_tokens": "generation.max_new_tokens", "seed": "generation.seed"})
    >>> table.read_options({"max_tokens": 8, "seed": None}, ("max_tokens", "seed"))
    {'max_new_tokens': 8}
    >>> [table.client_field(f) for f in ("generation.max_new_tokens", "requests[0].messages[1]",
    ...                                  "generation.min_new_tokens", "plugins[0].name")]
    ['max_tokens', 'messages[1]', 'engine.options.min_new_tokens', 'engine.plugins[0].name']
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
    """Whether the surface takes the ``engine: {options, stop, plugins}`` extension field: engine fields no client
    field names are then named inside it (``generation.x`` -> ``engine.options.x``)."""

    def read_options(self, section: Mapping[str, Any], names: tuple[str, ...], *, path: str = "") -> dict[str, Any]:
        """The generation options ``section`` sets through the client fields ``names`` (``path`` prefixes them in
        the table), by their engine names; absent and null fields set nothing."""
        options = {}
        for name in names:
            engine_field = self.fields[f"{path}{name}"]
            if section.get(name) is not None:
                options[engine_field.removeprefix("generation.")] = section[name]
        return options

    def sent(self, body: Any) -> FieldTable:
        """This table without the client fields ``body`` does not hold: where two client fields name one engine
        field (vLLM's ``min_tokens``, the extension's ``engine.options.min_new_tokens``), an error names the one the
        client sent.

        >>> table = FieldTable({"min_tokens": "generation.min_new_tokens"})
        >>> table.sent({"min_tokens": 3}).client_field("generation.min_new_tokens")
        'min_tokens'
        >>> table.sent({"engine": {"options": {"min_new_tokens": -1}}}).client_field("generation.min_new_tokens")
        'engine.options.min_new_tokens'
        """
        if not isinstance(body, Mapping):
            return self
        kept = {client: engine for client, engine in self.fields.items() if client.split(".")[0] in body}
        return FieldTable(MappingProxyType(kept), requests=self.requests, extension=self.extension)

    def client_field(self, engine_field: str) -> str:
        """The field as the client sent it."""
        for client, engine in self.fields.items():
            if engine == engine_field:
                return client
            if engine_field.startswith(f"{engine}["):  # an item of a listed field: stop.token_ids[1]
                return client + engine_field.removeprefix(engine)
        if engine_field.startswith("requests["):
            if self.requests is not None:
                return self.requests + engine_field.removeprefix("requests")
            return engine_field.removeprefix("requests[0].")
        if self.extension and (engine_field == "plugins" or engine_field.startswith("plugins[")):
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


def flag(body: Mapping[str, Any], key: str, default: bool = False, where: str = "") -> bool:
    """A boolean field of ``body`` (absent or null: ``default``); anything but true or false is refused by name
    (``where`` prefixes the field path).

    >>> flag({"echo": None}, "echo"), flag({}, "add_special_tokens", True)
    (False, True)
    >>> flag({"stream": 1}, "stream")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: stream must be true or false, got 1. Fix: send a boolean.
    """
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{key}", value, "must be true or false", fix="send a boolean")
    return value


def stop_strings(value: Any) -> dict[str, Any] | None:
    """A wire ``stop`` (a string or a list of strings, as the body model checked; None or [] for none) as an engine
    stop policy."""
    if value is None or value == []:
        return None
    return {"strings": [value] if isinstance(value, str) else list(value)}


def engine_extension(body: Mapping[str, Any], options: dict[str, Any], stop: dict[str, Any] | None, *,
                     options_from: str, stop_field: str) -> tuple[dict[str, Any], Any, Any]:
    """Merge the additive ``engine: {options, stop, plugins}`` envelope into what the wire's own fields set
    (``options``, ``stop``); a field set in both places is refused. Returns (options, stop, plugins)."""
    extension = body.get("engine") or {}  # its shape is checked by the surface's body model (bodies.py)
    extra = extension.get("options") or {}
    clash = sorted(set(extra) & set(options))
    if clash:
        raise RequestError(f"engine.options.{clash[0]}", extra[clash[0]], f"is also set {options_from}",
                           fix="set it in one place")
    options = {**options, **extra}
    if extension.get("stop") is not None:
        if stop is not None:
            raise RequestError("engine.stop", extension["stop"], f"conflicts with {stop_field}",
                               fix="give stop strings in one place")
        stop = dict(extension["stop"])
    return options, stop, extension.get("plugins")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as engine messages: text content parts joined into one string, other parts refused
    (the engine validates roles and the rest).

    >>> chat_messages([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}]}])
    [{'role': 'user', 'content': 'Hi !'}]
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", messages, "must be a non-empty list of messages",
                           fix='send [{"role": "user", "content": "..."}]')
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping) and isinstance(msg.get("content"), list):
            parts = []
            for j, part in enumerate(msg["content"]):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise RequestError(f"messages[{i}].content[{j}]", kind, "is not a text part (this endpoint "
                                       "serves text chat)", fix='send {"type": "text", "text": "..."} parts')
                parts.append(part["text"])
            msg = {**msg, "content": "".join(parts)}
        out.append(dict(msg) if isinstance(msg, Mapping) else msg)
    return out


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: int = 400) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- responses ------------------------------------------------------------------------------------------

FLOOR = -9999.0
"""What ``choices[].logprobs`` shows for a -inf log-probability (JSON has no infinities; vLLM's OpenAI server uses
the same floor). The ``/infer/`` envelope's ``token_logprobs`` keeps the exact value, as the string "-inf"."""


def shown_logprob(value: float) -> float:
    """The value shown in ``choices[].logprobs``.

    >>> shown_logprob(float("-inf")), shown_logprob(-0.5)
    (-9999.0, -0.5)
    """
    return value if math.isfinite(value) else FLOOR


def logprobs_content(result: GenerationResult, tokenizer: Any, top: int | None) -> dict[str, Any] | None:
    """Per-token logprobs in OpenAI's (and swift's) shape: token, logprob, bytes, and ``top`` alternatives."""
    if result.logprobs is None:
        return None
    content = []
    for token_id, step in zip(result.token_ids, result.logprobs, strict=True):
        token = tokenizer.decode([token_id])
        entry: dict[str, Any] = {"token": token, "logprob": shown_logprob(step[token_id]),
                                 "bytes": list(token.encode("utf8"))}
        if top is not None:
            best = sorted(step.items(), key=lambda kv: -kv[1])[:top]
            entry["top_logprobs"] = [{"token": (t := tokenizer.decode([k])), "logprob": shown_logprob(lp),
                                      "bytes": list(t.encode("utf8"))} for k, lp in best]
        content.append(entry)
    return {"content": content}


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
