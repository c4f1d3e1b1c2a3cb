"""Pattern C's request body (``POST /chat``), each field with what it is to the engine
(:mod:`engine.serve.shared.fields`): ``min_len`` and ``max_len`` become the ``min_length`` plugin's bounds.

>>> from engine.serve.shared.fields import FieldTable
>>> FieldTable.of(PatternCRequest).client_field("plugins[0].min_chars")
'min_len'
"""

from __future__ import annotations

from typing import Annotated

from engine.serve.shared.bodies import Body, Message
from engine.serve.shared.fields import Engine, Wire


class PatternCRequest(Body):
    """Pattern C ``POST /chat``."""

    model: Annotated[str | None, Wire("names the served model, when given")] = None
    messages: Annotated[list[Message], Wire("the conversation")]
    min_len: Annotated[int | None, Engine("plugins[0].min_chars", read=False)] = None
    max_len: Annotated[int | None, Engine("plugins[0].max_chars", read=False)] = None
    stream: Annotated[bool | None, Wire("answered as server-sent events")] = None
