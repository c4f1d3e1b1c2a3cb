"""What the wire formats write alike (``/infer/``, ``/v1/chat/completions``, ``/v1/completions``, Pattern C
``/chat``): per-token logprobs as clients read them, token names, usage. No web framework is imported here; what they
read alike is :mod:`engine.serve.shared.readers`.
"""

from __future__ import annotations

import math
from typing import Any

from engine.types import GenerationResult

FLOOR = -9999.0
"""What ``choices[].logprobs`` shows for a -inf log-probability (JSON has no infinities; vLLM's OpenAI server uses
the same floor). The ``/infer/`` envelope's ``token_logprobs`` keeps the exact value, as the string "-inf"."""


def shown_logprob(value: float) -> float:
    """The value shown in ``choices[].logprobs``.

    >>> shown_logprob(float("-inf")), shown_logprob(-0.5)
    (-9999.0, -0.5)
    """
    return value if math.isfinite(value) else FLOOR


def token_name(token_id: int, tokenizer: Any, as_ids: bool = False) -> str:
    """How logprobs name a token: its text, or ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``, for tokens
    whose text is not valid on its own, e.g. half of a UTF-8 character).

    >>> token_name(7, None, as_ids=True)
    'token_id:7'
    """
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def logprobs_content(result: GenerationResult, tokenizer: Any, top: int | None,
                     as_ids: bool = False) -> dict[str, Any] | None:
    """Per-token logprobs in OpenAI's (and swift's) shape: token (or ``"token_id:<id>"`` with ``as_ids``), logprob,
    bytes (of the token's text), and ``top`` alternatives."""
    if result.logprobs is None:
        return None
    content = []

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_name(token_id, tokenizer, as_ids), "logprob": shown_logprob(logprob),
                "bytes": list(tokenizer.decode([token_id]).encode("utf8"))}

    for token_id, step in zip(result.token_ids, result.logprobs, strict=True):
        chosen = entry(token_id, step[token_id])
        if top is not None:
            chosen["top_logprobs"] = [entry(k, lp) for k, lp in sorted(step.items(), key=lambda kv: -kv[1])[:top]]
        content.append(chosen)
    return {"content": content}


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
