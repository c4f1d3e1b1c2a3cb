"""The ``/infer/`` wire format (ms-swift's rollout protocol), both ways, in one place (what every surface shares:
:mod:`engine.serve.wire`).

Server side: :func:`parse_infer` turns a request body into engine arguments, refusing unknown and unsupported
fields with a :class:`RequestError` that names them; :func:`rollout_item` turns a ``GenerationResult`` into
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
from typing import Any

from engine.errors import RequestError
from engine.serve.wire import FieldTable, engine_extension, logprobs_content, stop_strings, usage
from engine.types import GenerationResult

# request_config keys swift's RequestConfig sends, and the value each must keep when we cannot honour another.
REQUIRED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,), "stream": (False,), "prompt_logprobs": (None,), "n": (1,), "best_of": (None, 1),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "length_penalty": (1, 1.0),
    "structured_outputs_regex": (None,),
}
ITEM_EMPTY = {"images": "image requests", "audios": "audio", "videos": "video", "tools": "tool calling",
              "objects": "multimodal objects", "chat_template_kwargs": "template arguments (thinking is always off)"}
FIELDS = FieldTable({
    "request_config.max_tokens": "generation.max_new_tokens", "request_config.temperature": "generation.temperature",
    "request_config.top_p": "generation.top_p", "request_config.top_k": "generation.top_k",
    "request_config.seed": "generation.seed", "request_config.repetition_penalty": "generation.repetition_penalty",
    "request_config.top_logprobs": "generation.logprobs", "request_config.min_p": "generation.min_p",
}, requests="infer_requests")
"""``/infer/``'s fields both ways: ``request_config`` reads into generation options, and the engine's errors name
``request_config.*``, ``infer_requests[i]`` and the ``engine`` extension's fields."""


@dataclass(frozen=True)
class InferCall:
    """One ``/infer/`` body, checked: what the engine is asked for and how to answer."""

    requests: list[list[dict[str, Any]]]
    options: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, Any] | None = None
    plugins: list[Any] | None = None
    return_details: bool = False
    top_logprobs: int | None = None
    """Top alternatives per token in ``choices[].logprobs`` (None: only the chosen token's)."""
    logprobs: bool = False


def parse_infer(body: Any) -> InferCall:
    """Check a ``/infer/`` body; raise ``RequestError`` naming the first bad field. Nothing is generated here.

    >>> parse_infer({"infer_requests": [{"messages": [{"role": "user", "content": "Hi"}]}],
    ...              "request_config": {"max_tokens": 8, "temperature": 0}}).options
    {'max_new_tokens': 8, 'temperature': 0}
    >>> parse_infer({"infer_requests": [], "request_config": {"n": 2}})
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: request_config.n is not supported by this server, got 2. Fix: use 1 (send \
the prompt several times for several samples).
    """
    from engine.serve.bodies import InferRequest, check

    check(InferRequest, body)
    if body.get("metrics"):
        raise RequestError("metrics", body["metrics"], "is not supported by this server",
                           fix="leave it null; compute metrics on the learner")
    if body.get("adapter_request") is not None:
        raise RequestError("adapter_request", body["adapter_request"], "is not supported (no LoRA serving)",
                           fix="leave it null")
    config = body.get("request_config") or {}
    for key, allowed in REQUIRED_DEFAULTS.items():
        value = config.get(key, allowed[0])
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            fix = "use 1 (send the prompt several times for several samples)" if key == "n" else \
                f"leave it at {allowed[0]!r}"
            raise RequestError(f"request_config.{key}", value, "is not supported by this server", fix=fix)
    options = FIELDS.read_options(config, ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed",
                                          "min_p"),
                                  path="request_config.")
    top_k = config.get("top_k")
    if top_k is not None:
        options["top_k"] = 0 if top_k == -1 else top_k  # -1 is "off" in swift and vLLM, 0 in the engine
    logprobs, top = bool(config.get("logprobs")), config.get("top_logprobs")
    if top is not None and not logprobs:
        raise RequestError("request_config.top_logprobs", top, "needs logprobs: true", fix="set logprobs to true")
    if logprobs:
        options["logprobs"] = 0 if top is None else top
    details = bool(config.get("return_details"))
    options, stop, plugins = engine_extension(body, options, stop_strings(config.get("stop")),
                                              options_from="through request_config", stop_field="request_config.stop")
    requests = _requests(body.get("infer_requests"))
    return InferCall(requests=requests, options=options, stop=stop, plugins=plugins,
                     return_details=details, top_logprobs=top, logprobs=logprobs)


def _requests(items: list[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    out = []
    for i, item in enumerate(items):
        where = f"infer_requests[{i}]"
        for key, what in ITEM_EMPTY.items():
            if item.get(key):
                raise RequestError(f"{where}.{key}", item[key], f"is not supported here ({what})",
                                   fix="leave it empty")
        if item.get("add_eos") is not None:
            raise RequestError(f"{where}.add_eos", item["add_eos"], "is not supported (no scoring)",
                               fix="leave it null")
        out.append(item["messages"])
    return out


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
