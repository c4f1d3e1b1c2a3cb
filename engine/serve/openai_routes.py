"""OpenAI's surface: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events).

Wire formats: :mod:`engine.serve.openai_wire` (chat) and :mod:`engine.serve.completions_wire` (text). Every answer is
one ``GenerationEngine`` call (``agenerate``/``astream`` for chat, ``acomplete``/``astream_complete`` for text, and
``ascore`` for an echoed prompt's logprobs), so the streamed text equals the non-streamed text equals the in-process
``generate``/``complete`` text.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from engine.errors import EngineError, RequestError
from engine.serve import completions_wire as text_wire
from engine.serve import openai_wire as wire
from engine.serve.answering import Answering, unknown_model
from engine.serve.limits import check_call
from engine.serve.service import ServedEngine
from engine.serve.wire import usage


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine
    calls = Answering(served, "chat_completions", wire.TABLE)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": int(served.started),
                                            "owned_by": "engine", "root": engine.config.model.path,
                                            "max_model_len": engine.backend.capabilities.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        start = time.perf_counter()
        body, answer = await calls.read(request, start)
        if answer is None:
            return body
        try:
            call = wire.parse_completion(body)
            check_call(served.serve, prompts=1, options=call.options, stop=call.stop,
                       max_model_len=engine.backend.capabilities.max_model_len)
        except EngineError as err:
            return answer.refused(err, start)
        if call.model != served.model_name:
            answer.observe(404, start)
            return unknown_model(call.model, served)
        kwargs = {"options": call.options or None, "stop": call.stop, "plugins": call.plugins,
                  "json_schema": call.json_schema}
        model = served.model_name
        if call.stream:
            try:  # validation (messages, options, plugins, context length) raises here, before any generation
                stream = engine.astream(call.messages, **kwargs)
            except EngineError as err:
                return answer.refused(err, start)
            cid, created = wire.completion_id(), int(time.time())

            def events(part: Any) -> list[Any]:
                out = []
                if part.delta:
                    out.append(wire.chunk(cid, created, model, call, delta={"content": part.delta}))
                if part.result is not None:
                    out.append(wire.chunk(cid, created, model, call, result=part.result, tokenizer=engine.tokenizer))
                    if call.include_usage:
                        out.append(wire.chunk(cid, created, model, call, result=part.result, usage_only=True))
                return out

            role = wire.chunk(cid, created, model, call, delta={"role": "assistant", "content": ""})
            return answer.stream(stream, start, events, first=[role])
        return await answer.whole(request, start, [call.messages], kwargs, body=lambda results:
                                 wire.completion_body(results[0], call, model=model, tokenizer=engine.tokenizer))

    text_calls = Answering(served, "completions", text_wire.TABLE)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        start = time.perf_counter()
        body, answer = await text_calls.read(request, start)
        if answer is None:
            return body
        try:
            call = text_wire.parse_text_completion(body, engine.tokenizer)
            check_call(served.serve, prompts=len(call.prompts), options=call.options, stop=call.stop,
                       max_model_len=engine.backend.capabilities.max_model_len)
            if call.stream and (len(call.prompts) > 1 or not call.generates):
                raise RequestError("stream", True, f"streams one prompt's answer ({len(call.prompts)} prompts, "
                                   f"max_tokens {call.options['max_new_tokens']})",
                                   fix="send one prompt and max_tokens >= 1 per streamed request, or stream: false")
            # Validated here, before anything runs: a scoring-only call (max_tokens 0) checks its options as if it
            # generated one token.
            kwargs = {"options": call.options if call.generates else {**call.options, "max_new_tokens": 1},
                      "stop": call.stop, "plugins": call.plugins, "json_schema": call.json_schema}
            engine.prepare_plain(call.prompts, **kwargs)
            scored = [i for i, p in enumerate(call.prompts) if call.scores_prompt and len(p) > 1]
            sequences = [call.prompts[i] for i in scored]
            if call.scores_prompt:
                engine.check_scoring(sequences, [1] * len(sequences), call.logprobs)
        except EngineError as err:
            return answer.refused(err, start)
        if call.model != served.model_name:
            answer.observe(404, start)
            return unknown_model(call.model, served)
        model = served.model_name

        async def prompt_scores() -> list[Any]:
            found = await engine.ascore(sequences, [1] * len(sequences), call.logprobs) if sequences else []
            by_prompt: list[Any] = [None] * len(call.prompts)
            for i, score in zip(scored, found, strict=True):
                by_prompt[i] = score
            return by_prompt

        if call.stream:
            try:
                stream = engine.astream_complete(call.prompts[0], **kwargs)
                scores = await prompt_scores() if call.echo else [None]
            except EngineError as err:
                return answer.refused(err, start)
            cid, created = text_wire.completion_id(), int(time.time())
            first = []
            if call.echo:
                echoed = text_wire.choice_logprobs(call, 0, None, scores[0], engine.tokenizer, answer=False)
                first.append(text_wire.chunk(cid, created, model, text=call.texts[0], logprobs=echoed))

            def events(part: Any) -> list[Any]:
                out = []
                if part.delta:
                    out.append(text_wire.chunk(cid, created, model, text=part.delta))
                if part.result is not None:
                    logprobs = text_wire.choice_logprobs(call, 0, part.result, None, engine.tokenizer, prompt=False)
                    out.append(text_wire.chunk(cid, created, model, logprobs=logprobs,
                                               finish_reason=part.result.finish_reason))
                    if call.include_usage:
                        out.append(text_wire.chunk(cid, created, model, usage=usage(part.result)))
                return out

            return answer.stream(stream, start, events, first=first)

        async def run() -> tuple[list[Any], list[Any]]:
            scores = await prompt_scores()
            results = await engine.acomplete(call.prompts, **kwargs) if call.generates else [None] * len(scores)
            return results, scores

        return await answer.whole_of(
            request, start, run, counted=lambda out: [r for r in out[0] if r is not None],
            body=lambda out: text_wire.completion_body(call, out[0], out[1], model=model, tokenizer=engine.tokenizer))

    return api
