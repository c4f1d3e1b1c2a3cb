"""Pattern C's ``POST /chat`` ("Pattern C" is the seeds' name for min-length chat): min-length control inside
generation, answered as ``{text, meta}`` or streamed.

Wire format and the defaults it fills in: :mod:`engine.serve.pattern_c.chat`; the call path:
:mod:`engine.serve.shared.calls`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from engine.serve.pattern_c import chat as wire
from engine.serve.pattern_c.bodies import PatternCRequest
from engine.serve.service import ServedEngine
from engine.serve.shared.calls import Call, Surface

BODIES = {"/chat": PatternCRequest}


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    chats = Surface(served, "chat", PatternCRequest, lambda body, served: wire.parse_pattern_c(body, served.serve.chat),
                    prepare=lambda c, served: served.engine.prepare([c.messages], **c.kwargs))  # off the event loop

    @chats.route(api, "/chat")
    async def chat(call: Call) -> Any:
        return await wire.answer(call, served)

    return api
