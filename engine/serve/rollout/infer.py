"""The ``/infer/`` wire format (ms-swift's rollout protocol), both ways, in one place (what every surface shares:
:mod:`engine.serve.shared.readers` and :mod:`engine.serve.shared.writers`).

Server side: :func:`parse_infer` reads a validated body (``rollout/bodies.py``) into engine arguments, refusing
unsupported fields with a :class:`RequestError` that names them; :func:`rollout_item` turns a ``GenerationResult`` into
``{"response": <ChatCompletionResponse dict>, "<namespace>": {<envelope>}}``. Client side: :func:`result_from_item`
reads an item back into a ``GenerationResult``. No web framework is imported here.

The envelope is additive: ``response`` is byte-for-byte the item an unwrapped server returns (``namespace:
null``); the namespace holds what the learner needs beyond it, first of all ``repeat_terminate_triggered``
(0|1, reported by the guard itself), and what makes the result whole (``raw_text``, ``stop_reason``, the
engine's per-token logprobs and ``meta``).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import RequestError
from engine.serve.shared.readers import engine_extension, stop_strings
from engine.serve.shared.writers import logprobs_content, usage
from engine.types import GenerationResult

if TYPE_CHECKING:  # the learner's side (engine.client) reads answers only: no pydantic on its import
    from engine.serve.rollout.bodies import InferItem, InferRequest

UNSERVED = {"images": "image requests", "audios": "audio", "videos": "video", "tools": "tool calling",
            "objects": "multimodal objects", "chat_template_kwargs": "template arguments (thinking is always off)"}
"""``infer_requests[i]`` fields that must stay empty, and what they would ask for."""


@dataclass(frozen=True)
class InferCall:
    """One ``/infer/`` body, checked: what the engine is asked for and how to answer."""

    requests: list[list[dict[str, Any]]]
    options: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, Any] | None = None
    plugins: list[Any] | None = None
    repeat_terminate: dict[str, Any] | None = None
    """The repeat guard's fields for this call (``engine.repeat_terminate``), laid over the server's guard."""
    return_details: bool = False
    top_logprobs: int | None = None
    """Top alternatives per token in ``choices[].logprobs`` (None: only the chosen token's)."""
    logprobs: bool = False
    model: None = None
    """swift's protocol names no model."""
    adapter: str | None = None
    """swift's ``adapter_request.name``: a LoRA adapter the server has loaded (None: the served model)."""

    @property
    def prompt_count(self) -> int:
        return len(self.requests)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The engine call's keyword arguments."""
        return {"options": self.options or None, "stop": self.stop, "plugins": self.plugins,
                "repeat_terminate": self.repeat_terminate, "adapter": self.adapter}


def leave_it_at(name: str, allowed: tuple[Any, ...]) -> str:
    if name == "n":
        return "use 1 (send the prompt several times for several samples)"
    return f"leave it at {allowed[0]!r}"


def parse_infer(body: InferRequest, served: Any = None) -> InferCall:
    """Read a validated ``/infer/`` body; raise ``RequestError`` naming the first bad field. Nothing is generated.

    >>> from engine.serve.rollout.bodies import InferRequest
    >>> def infer(**config):
    ...     return parse_infer(InferRequest.model_validate({"infer_requests": [{"messages": [{"role": "user",
    ...                                                     "content": "Hi"}]}], "request_config": config}))
    >>> infer(max_tokens=8, temperature=0).options
    {'temperature': 0, 'max_new_tokens': 8}
    >>> infer(n=2)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: request_config.n is not supported by this server, got 2. Fix: use 1 (send \
the prompt several times for several samples).
    """
    from engine.serve.shared.fields import engine_options, neutral_values

    if body.metrics:
        raise RequestError("metrics", body.metrics, "is not supported by this server",
                           fix="leave it null; compute metrics on the learner")
    adapter = (getattr(served, "default_adapter", None) if body.adapter_request is None
               else adapter_name(body.adapter_request, served))
    config = body.request_config
    options: dict[str, Any] = {}
    logprobs, top, details, stop = False, None, False, None
    if config is not None:
        neutral_values(config, "request_config.", fix=leave_it_at)
        options = engine_options(config)
        logprobs, top = bool(config.logprobs), config.top_logprobs
        if top is not None and not logprobs:
            raise RequestError("request_config.top_logprobs", top, "needs logprobs: true",
                               fix="set logprobs to true")
        if logprobs:
            options["logprobs"] = 0 if top is None else top
        details, stop = bool(config.return_details), stop_strings(config.stop)
    options, stop, plugins, guard = engine_extension(body.engine, options, stop,
                                                     options_from="through request_config",
                                                     stop_field="request_config.stop")
    return InferCall(requests=[_messages(i, item) for i, item in enumerate(body.infer_requests)], options=options,
                     stop=stop, plugins=plugins, repeat_terminate=guard, return_details=details, top_logprobs=top,
                     logprobs=logprobs, adapter=adapter)


def adapter_name(request: dict[str, Any], served: Any) -> str:
    """swift's ``adapter_request`` (``{"name", "path"}``, its ``AdapterRequest``): the name of an adapter this server
    has loaded. swift's own engine loads an unknown name from its path on first use; this server reads adapter files
    only at start (``model.adapters``, ``--lora-modules``) and on ``/v1/load_lora_adapter``, never on a generation
    route, so an unknown name is refused by field with where to load it."""
    name = request.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("adapter_request.name", name, "must name a loaded LoRA adapter",
                           fix="send {'name': <adapter>, 'path': <folder>} as swift's AdapterRequest")
    loaded = getattr(served, "adapters", ())
    if name not in loaded:
        raise RequestError("adapter_request.name", name, f"is not a loaded adapter (loaded: "
                           f"{', '.join(loaded) or 'none'})", fix="load it first (POST /v1/load_lora_adapter on a "
                           "server started with --allow-adapter-loading), or start the server with it "
                           "(--lora-modules name=path)")
    return name


def _messages(i: int, item: InferItem) -> list[dict[str, Any]]:
    where = f"infer_requests[{i}]"
    for key, what in UNSERVED.items():
        if getattr(item, key):
            raise RequestError(f"{where}.{key}", getattr(item, key), f"is not supported here ({what})",
                               fix="leave it empty")
    if item.add_eos is not None:
        raise RequestError(f"{where}.add_eos", item.add_eos, "is not supported (no scoring)", fix="leave it null")
    return [m.model_dump(exclude_unset=True) for m in item.messages]


# -- responses ------------------------------------------------------------------------------------------


def _exact(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)


def chat_completion(result: GenerationResult, call: InferCall, *, model: str, tokenizer: Any) -> dict[str, Any]:
    """The ``ChatCompletionResponse`` dict an unwrapped swift rollout server returns for one request."""
    details = call.return_details
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text, "tool_calls": None, "reasoning_content": None},
        "finish_reason": result.finish_reason,
        "logprobs": logprobs_content(result, tokenizer, call.top_logprobs) if call.logprobs else None,
        "token_ids": list(result.token_ids) if details else None,
        "routed_experts": None,
    }
    return {
        "model": model,
        "choices": [choice],
        "usage": usage(result),
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "prompt_token_ids": list(result.prompt_token_ids) if details else None,
        "prompt_logprobs": None,
        "images_size": None,
    }


def envelope(result: GenerationResult) -> dict[str, Any]:
    """The namespace's content: the guard's own flag first, then what makes the result whole."""
    return {
        "repeat_terminate_triggered": int(result.meta.get("repeat_terminate_triggered", 0)),
        "repeat_terminate_index": result.meta.get("repeat_terminate_index"),
        "repeat_terminate_reason": result.meta.get("repeat_terminate_reason"),
        "stop_reason": result.stop_reason,
        "raw_text": result.raw_text,
        "token_logprobs": None if result.logprobs is None else [[[k, _exact(v)] for k, v in sorted(s.items())]
                                                                for s in result.logprobs],
        "meta": result.meta,
    }


def rollout_item(result: GenerationResult, call: InferCall, *, model: str, tokenizer: Any,
                 namespace: str | None) -> dict[str, Any]:
    """One ``/infer/`` item: the bare response when ``namespace`` is None, else ``{response, namespace: ...}``."""
    response = chat_completion(result, call, model=model, tokenizer=tokenizer)
    if namespace is None:
        return response
    return {"response": response, namespace: envelope(result)}


def result_from_item(item: Mapping[str, Any], namespace: str) -> GenerationResult:
    """A ``GenerationResult`` from an enveloped item (sent with ``return_details: true``).

    The trigger flag comes from the envelope, never from the finish reason."""
    if namespace not in item:
        raise RequestError(f"item.{namespace}", sorted(item), "is missing: the server sends no envelope under "
                           "this namespace", fix="start the server with serve.namespace set to it")
    response, env = item["response"], item[namespace]
    choice = response["choices"][0]
    if choice.get("token_ids") is None or response.get("prompt_token_ids") is None:
        raise RequestError("request_config.return_details", False, "must be true to rebuild results",
                           fix="send return_details: true")
    logprobs = None
    if env.get("token_logprobs") is not None:
        logprobs = tuple({int(k): float(v) for k, v in step} for step in env["token_logprobs"])
    meta = dict(env.get("meta") or {})
    meta["repeat_terminate_triggered"] = int(env["repeat_terminate_triggered"])
    return GenerationResult(text=choice["message"]["content"], raw_text=env["raw_text"],
                            token_ids=tuple(choice["token_ids"]), prompt_token_ids=tuple(response["prompt_token_ids"]),
                            finish_reason=choice["finish_reason"], stop_reason=env["stop_reason"], logprobs=logprobs,
                            meta=meta)


async def answer(call: Any, served: Any) -> Any:
    """The parsed call's answer through the one call path (:class:`engine.serve.shared.calls.Call`): one
    ``agenerate`` of its requests, each result a rollout item (:func:`rollout_item`)."""
    c, engine = call.parsed, served.engine
    def body(results: list[Any]) -> list[dict[str, Any]]:
        return [rollout_item(r, c, model=served.model_name, tokenizer=engine.tokenizer,
                             namespace=served.serve.namespace) for r in results]

    return await call.whole(lambda: engine.agenerate(c.requests, **c.kwargs, prepared=call.prepared), body=body)
