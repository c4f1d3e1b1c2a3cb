"""Pattern C's ``POST /chat`` ("Pattern C" is the seeds' name for min-length chat): min-length control inside
generation, answered as ``{text, meta}`` or streamed.

Wire format and the defaults it fills in: :mod:`engine.serve.pattern_c_wire`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from engine.errors import EngineError
from engine.serve import pattern_c_wire as wire
from engine.serve.answering import Answering, unknown_model
from engine.serve.limits import check_call, read_json
from engine.serve.service import ServedEngine


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine
    calls = Answering(served, "chat", wire.TABLE)

    @api.post("/chat")
    async def chat(request: Request) -> Any:
        start = time.perf_counter()
        try:
            call = wire.parse_pattern_c(await read_json(request, served.serve.max_body_bytes), served.serve.chat)
            check_call(served.serve, prompts=1, options=call.options, stop=None,
                       max_model_len=engine.backend.capabilities.max_model_len)
        except EngineError as err:
            return calls.refused(err, start)
        if call.model is not None and call.model != served.model_name:
            calls.observe(404, start)
            return unknown_model(call.model, served)
        kwargs = {"options": call.options, "plugins": call.plugins}
        model = served.model_name
        if call.stream:
            try:
                stream = engine.astream(call.messages, **kwargs)
            except EngineError as err:
                return calls.refused(err, start)

            def events(part: Any) -> list[Any]:
                out: list[Any] = [{"delta": part.delta}] if part.delta else []
                if part.result is not None:
                    out.append(wire.pattern_c_body(part.result, call, model=model))
                return out

            return calls.stream(stream, start, events)
        return await calls.whole(request, start, [call.messages], kwargs,
                                 body=lambda results: wire.pattern_c_body(results[0], call, model=model))

    return api
