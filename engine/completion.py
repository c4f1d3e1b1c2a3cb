"""Requests without a chat template: plain prompts to continue, sequences to score, and JSON Schemas to
constrain by. What the lm-eval model sends (its contexts are rendered already); checked before generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import RequestError
from engine.templates import RenderedPrompt

PromptLike = str | Sequence[int]


def plain_prompts(tokenizer: Any, prompts: Sequence[PromptLike], limit: int | None) -> list[RenderedPrompt]:
    """Each prompt as the model will see it: text is tokenized as is (no special tokens added, no template);
    token ids are taken as given.

    >>> class Tok:
    ...     def __len__(self): return 10
    ...     def encode(self, text, add_special_tokens): return [len(w) for w in text.split()]
    ...     def decode(self, ids): return " ".join("x" * i for i in ids)
    >>> [p.token_ids for p in plain_prompts(Tok(), ["ab c", [3, 1]], limit=None)]
    [(2, 1), (3, 1)]
    >>> plain_prompts(Tok(), [[3, 12]], limit=None)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: prompts[0][1] is not a token id of this tokenizer (0 to 9), got 12. Fix: tokenize \
with the model's own tokenizer.
    """
    vocab = len(tokenizer)
    rendered = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
            text = prompt
        else:
            ids = tuple(prompt)
            for j, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise RequestError(f"prompts[{i}][{j}]", t,
                                       f"is not a token id of this tokenizer (0 to {vocab - 1})",
                                       fix="tokenize with the model's own tokenizer")
            text = tokenizer.decode(list(ids))
        if not ids:
            raise RequestError(f"prompts[{i}]", prompt, "is empty", fix="give at least one token to continue")
        if limit is not None and len(ids) >= limit:
            raise RequestError(f"prompts[{i}]", f"{len(ids)} prompt tokens",
                               f"leave no room to generate within the model's context length ({limit} tokens)",
                               fix="truncate the prompt from the left")
        rendered.append(RenderedPrompt(text=text, token_ids=ids, fallback=None))
    return rendered


def check_scored(sequences: Sequence[Sequence[int]], starts: Sequence[int], limit: int | None) -> None:
    """Every sequence fits the context and scores at least one token after at least one token of context.

    >>> check_scored([[1, 2, 3]], [0], limit=None)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: starts[0] is outside [1, 2], got 0. Fix: keep at least one token of context \
before the first scored token and score at least one token.
    """
    if len(sequences) != len(starts):
        raise RequestError("starts", len(starts), f"must have one entry per sequence ({len(sequences)})",
                           fix="give the first scored position of every sequence")
    for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start < len(seq):
            raise RequestError(f"starts[{i}]", start, f"is outside [1, {len(seq) - 1}]",
                               fix="keep at least one token of context before the first scored token and score "
                                   "at least one token")
        if limit is not None and len(seq) > limit:
            raise RequestError(f"sequences[{i}]", f"{len(seq)} tokens",
                               f"exceed the model's context length ({limit} tokens)",
                               fix="score it in windows (as loglikelihood_rolling does) or truncate it from the left")


def canonical_schema(schema: Mapping[str, Any] | str | None) -> str | None:
    """A JSON Schema as canonical JSON text (sorted keys, no spaces): the form backends and cache keys use.

    >>> canonical_schema('{"type": "object", "required": ["a"]}')
    '{"required":["a"],"type":"object"}'
    >>> canonical_schema("[1]")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: json_schema is not a JSON object, got '[1]'. Fix: give a JSON Schema object such \
as {"type": "object"}.
    """
    if schema is None:
        return None
    value: Any = schema
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as err:
            raise RequestError("json_schema", schema, f"is not JSON ({err})", fix="give a JSON Schema object") from err
    if not isinstance(value, Mapping):
        raise RequestError("json_schema", schema, "is not a JSON object",
                           fix='give a JSON Schema object such as {"type": "object"}')
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
