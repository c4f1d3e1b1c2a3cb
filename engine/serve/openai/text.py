"""OpenAI's text completions wire format (``POST /v1/completions``), both ways, as ``vllm serve`` takes it (what the
chat surface shares with it: :mod:`engine.serve.openai.sampling`). No web framework is imported here.

Choices written down:

* ``prompt``: a string, a list of strings, a list of token ids, or a list of such lists; every prompt is one choice
  (``choices[i].index == i``). Text is tokenized with special tokens unless ``add_special_tokens`` is false (vLLM's
  field and default); token ids are taken as given. Either way the engine continues the ids as they are, no chat
  template (``GenerationEngine.complete``).
* ``max_tokens`` defaults to 16 (OpenAI's and vLLM's default for this route); 0 is allowed with ``echo`` only (the
  prompt scored, nothing generated), as vLLM allows it.
* ``logprobs: k`` (an integer, k in [0, 20]) gives OpenAI's legacy object per choice: ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (the k likeliest tokens and the chosen one, by their text) and ``text_offset`` (where each token's
  text starts in the choice's ``text``).
* ``echo: true`` puts the prompt before the answer: its text (as sent; token ids decoded) and, with ``logprobs``, its
  tokens scored by the model (the first has no logprob: ``null``), the numbers lm-eval's ``local-completions`` model
  reads for log-likelihoods. Scoring needs a backend that scores (HF, vLLM); llama.cpp refuses ``echo`` with
  ``logprobs`` by name.
* ``best_of`` (1 only), ``suffix`` (empty only) and the penalties are taken at their neutral value, as on the chat
  route. ``n`` gives each prompt ``n`` choices, as on the chat route: choice ``k`` answers prompt ``k // n`` (vLLM's
  order), an echoed prompt is scored once and shown in each of its choices.
* ``stream`` answers one prompt that generates (``max_tokens`` >= 1); several prompts, or scoring only, are a 400.
* Streamed: the first chunk carries the echoed prompt (and its logprobs), the text deltas follow, the chunk with the
  ``finish_reason`` carries the answer's logprobs; all chunks' texts together equal the non-streamed ``text``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.backends.base import TokenScores
from engine.errors import RequestError, RequestTooLarge
from engine.serve.openai.bodies import CompletionRequest
from engine.serve.openai.sampling import OpenAICall, parse_openai_call
from engine.serve.shared.writers import shown_logprob, token_name, usage
from engine.types import GenerationResult

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class TextCompletionCall(OpenAICall):
    """One checked ``/v1/completions`` body: the prompts (token ids and the text to echo), what the engine is asked
    for, and how to answer."""

    prompts: list[list[int]]
    texts: list[str]
    """Each prompt as the client sent it (text), or its ids decoded: what ``echo`` shows."""
    echo: bool = False
    logprobs: int | None = None

    @property
    def prompt_count(self) -> int:
        """The rows this call generates: each prompt ``n`` times."""
        return len(self.prompts) * self.n

    @property
    def rows(self) -> list[list[int]]:
        """The prompts as generated: each one ``n`` times in a row (choice ``k`` answers prompt ``k // n``)."""
        return [p for p in self.prompts for _ in range(self.n)]

    @property
    def generates(self) -> bool:
        """False for ``max_tokens: 0`` (with ``echo``): the prompts are only scored."""
        return self.options.get("max_new_tokens") != 0

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def kwargs(self) -> dict[str, Any]:
        """The engine call's keyword arguments; a scoring-only call (``max_tokens: 0``) checks its options as if it
        generated one token."""
        return {"options": self.options if self.generates else {**self.options, "max_new_tokens": 1},
                "stop": self.stop, "plugins": self.plugins, "json_schema": self.json_schema,
                "repeat_terminate": self.repeat_terminate}

    @property
    def scored(self) -> list[int]:
        """The prompts whose tokens are scored (echo with logprobs; a one-token prompt has nothing to score)."""
        return [i for i, p in enumerate(self.prompts) if self.scores_prompt and len(p) > 1]


def _prompts(value: Any, engine: Any, special: bool, rows: int | None) -> tuple[list[list[int]], list[str]]:
    """``prompt`` as token-id lists, and the text each shows when echoed; ``rows``: the most prompts (times ``n``)
    a call may hold, checked before any is tokenized, as is each text's size."""
    example = 'e.g. "Once upon a time", ["a", "b"], [1, 2, 3] or [[1, 2], [3]]'
    flat_ids = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    one = isinstance(value, str) or flat_ids  # errors then name "prompt" itself
    if one:
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError("prompt", value, "is required: a string, a list of strings, or token ids", fix=example)
    if rows is not None and len(value) > rows:
        raise RequestTooLarge("requests", len(value), f"holds more than serve.max_prompts_per_call ({rows}) "
                              "prompts", fix=f"split it into calls of at most {rows}, or raise the limit")
    for i, item in enumerate(value):
        if isinstance(item, str):
            engine.check_chars("prompt" if one else f"prompt[{i}]", len(item), fix="send a shorter prompt")
    tokenizer = engine.tokenizer
    ids, texts, vocab = [], [], len(tokenizer)
    for i, item in enumerate(value):
        if isinstance(item, str):
            ids.append(list(tokenizer.encode(item, add_special_tokens=special)))
            texts.append(item)
            continue
        if not isinstance(item, list):
            raise RequestError(f"prompt[{i}]", item, "must be a string or a list of token ids", fix=example)
        for j, t in enumerate(item):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError(f"prompt[{i}][{j}]", t, f"is not a token id of this model (its tokenizer has "
                                   f"{vocab})", fix=f"give ids in [0, {vocab}), from the model's own tokenizer")
        ids.append(item)
        texts.append(tokenizer.decode(item))
    return ids, texts


def parse_text_completion(body: CompletionRequest, engine: Any, max_prompts: int | None = None) -> TextCompletionCall:
    """Read a validated text completions body; raise ``RequestError`` naming the first bad field. Nothing is generated;
    ``engine`` gives the tokenizer and refuses a text too long for the context before it is tokenized
    (``check_chars``); more than ``max_prompts`` prompts are refused before any is tokenized.

    >>> from types import SimpleNamespace
    >>> class Tok:
    ...     def __len__(self): return 200
    ...     def encode(self, text, add_special_tokens): return [1] * add_special_tokens + [ord(c) for c in text]
    ...     def decode(self, ids): return "".join(map(chr, ids))
    >>> engine = SimpleNamespace(tokenizer=Tok(), check_chars=lambda field, chars, fix="": None)
    >>> def text(**fields):
    ...     return parse_text_completion(CompletionRequest.model_validate({"model": "m", **fields}), engine)
    >>> call = text(prompt="hi", echo=True, logprobs=1)
    >>> call.prompts, call.texts, call.options
    ([[1, 104, 105]], ['hi'], {'logprobs': 1, 'max_new_tokens': 16})
    >>> text(prompt=[[104, 105], [33]]).texts
    ['hi', '!']
    >>> text(prompt=[[5, 6], [7]], max_tokens=0)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: max_tokens is 0, which only echo allows, got 0. Fix: set echo to true to score \
the prompt, or ask for at least one token.
    """
    echo = bool(body.echo)
    special = body.add_special_tokens is not False
    zero = body.max_tokens == 0
    if zero and not echo:
        raise RequestError("max_tokens", 0, "is 0, which only echo allows",
                           fix="set echo to true to score the prompt, or ask for at least one token")
    common = parse_openai_call(body, {} if body.max_tokens is None or zero else {"max_new_tokens": body.max_tokens})
    options = dict(common.options)
    options.setdefault("max_new_tokens", 0 if zero else DEFAULT_MAX_TOKENS)
    rows = None if max_prompts is None else max(1, max_prompts // common.n)
    prompts, texts = _prompts(body.prompt, engine, special, rows)
    return TextCompletionCall(**{**common.shared(), "options": options}, prompts=prompts, texts=texts, echo=echo,
                              logprobs=body.logprobs)


def prepare(call: TextCompletionCall, served: Any) -> Any:
    """The engine's own checks of a text call, after the server's limits and before anything runs: the prompts and
    options (``prepare_plain``, whose result the route runs), and the scoring of echoed prompts."""
    if call.stream and (len(call.prompts) > 1 or not call.generates):
        raise RequestError("stream", True, f"streams one prompt's answer ({len(call.prompts)} prompts, "
                           f"max_tokens {call.options['max_new_tokens']})",
                           fix="send one prompt and max_tokens >= 1 per streamed request, or stream: false")
    engine = served.engine
    adapter = served.adapter_of(call.model)
    prepared = engine.prepare_plain(call.rows, **call.kwargs, adapter=adapter)
    if call.scores_prompt and adapter is not None:
        raise RequestError("model", call.model, "is a LoRA adapter, and echoed prompts are scored with the served "
                           "model only here", fix="send echo without logprobs for an adapter, or name the served "
                           "model to score")
    if call.scores_prompt:
        sequences = [call.prompts[i] for i in call.scored]
        scored, budget = sum(len(seq) for seq in sequences), served.serve.max_scored_tokens
        if scored > budget:
            raise RequestTooLarge("prompt", f"{scored} prompt tokens to score", f"is more than "
                                  f"serve.max_scored_tokens ({budget}) in one call with echo and logprobs",
                                  fix="send fewer or shorter prompts per call, or raise serve.max_scored_tokens")
        engine.check_scoring(sequences, [1] * len(sequences), call.logprobs)
    return prepared


# -- responses ------------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def legacy_logprobs(token_ids: Sequence[int], steps: Sequence[tuple[float | None, Mapping[int, float] | None]],
                    tokenizer: Any, offset: int = 0, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's legacy logprobs object for ``token_ids``: ``steps[j]`` is token j's logprob and its alternatives
    (token id -> logprob, the chosen one included), ``(None, None)`` where there are none (a prompt's first token);
    ``offset`` is where the first token's text starts in the choice's text. ``as_ids`` names each token
    ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``; the offsets then advance by those names, as vLLM's do).

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(decode=lambda ids: "".join(chr(96 + i) for i in ids))
    >>> legacy_logprobs([1, 2], [(None, None), (-0.5, {2: -0.5, 3: -1.5})], tok, offset=4)
    {'tokens': ['a', 'b'], 'token_logprobs': [None, -0.5], 'top_logprobs': [None, {'b': -0.5, 'c': -1.5}], \
'text_offset': [4, 5]}
    >>> legacy_logprobs([2], [(-0.5, {2: -0.5, 3: -1.5})], tok, as_ids=True)["top_logprobs"]
    [{'token_id:2': -0.5, 'token_id:3': -1.5}]
    """
    tokens, logprobs, tops, offsets = [], [], [], []
    for token_id, (logprob, alternatives) in zip(token_ids, steps, strict=True):
        text = token_name(token_id, tokenizer, as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        logprobs.append(None if logprob is None else shown_logprob(logprob))
        tops.append(None if alternatives is None else _by_text(alternatives, tokenizer, as_ids))
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _by_text(alternatives: Mapping[int, float], tokenizer: Any, as_ids: bool) -> dict[str, float]:
    """Alternatives keyed by token text (or ``"token_id:<id>"``), likeliest first; two tokens with one text keep the
    likelier logprob."""
    out: dict[str, float] = {}
    for token_id, logprob in sorted(alternatives.items(), key=lambda kv: -kv[1]):
        out.setdefault(token_name(token_id, tokenizer, as_ids), shown_logprob(logprob))
    return out


def prompt_steps(scores: TokenScores | None, length: int) -> list[tuple[float | None, Mapping[int, float] | None]]:
    """An echoed prompt's steps for :func:`legacy_logprobs`: none for its first token, then ``scores`` (None for a
    one-token prompt, which has nothing to score)."""
    steps: list[tuple[float | None, Mapping[int, float] | None]] = [(None, None)]
    if scores is not None:
        steps += list(zip(scores.logprobs, scores.top or [None] * len(scores.logprobs), strict=True))
    assert len(steps) == length, (len(steps), length)
    return steps


def answer_steps(result: GenerationResult) -> list[tuple[float | None, Mapping[int, float] | None]]:
    assert result.logprobs is not None
    return [(step[t], step) for t, step in zip(result.token_ids, result.logprobs, strict=True)]


def choice_logprobs(call: TextCompletionCall, index: int, result: GenerationResult | None,
                    scores: TokenScores | None, tokenizer: Any, *, prompt: bool = True,
                    answer: bool = True) -> dict[str, Any] | None:
    """One choice's legacy logprobs: the echoed prompt's (``prompt``) then the answer's (``answer``)."""
    if call.logprobs is None:
        return None
    ids: list[int] = []
    steps: list[tuple[float | None, Mapping[int, float] | None]] = []
    if call.echo and prompt:
        ids += call.prompts[index]
        steps += prompt_steps(scores, len(call.prompts[index]))
    if result is not None and answer:
        ids += result.token_ids
        steps += answer_steps(result)
    offset = len(shown_prompt(call, index)) if call.echo and not prompt else 0
    return legacy_logprobs(ids, steps, tokenizer, offset=offset, as_ids=call.tokens_as_ids)


def shown_prompt(call: TextCompletionCall, index: int) -> str:
    """What ``echo`` puts before prompt ``index``'s answer: its text, or nothing when the client asked for token ids
    (``return_token_ids``: the ids are in ``prompt_token_ids``, and vLLM does not detokenize the prompt then)."""
    return "" if call.return_token_ids else call.texts[index]


def completion_body(call: TextCompletionCall, results: Sequence[GenerationResult | None],
                    scores: Sequence[TokenScores | None], *, model: str, tokenizer: Any) -> dict[str, Any]:
    """The ``text_completion`` object: ``n`` choices per prompt, choice ``k`` answering prompt ``k // n``
    (``results[k]`` None when nothing was generated; ``scores[i]``: prompt ``i``'s echoed scores). ``usage`` counts
    each prompt once and every choice's tokens."""
    choices = []
    prompt_tokens = sum(len(p) for p in call.prompts)
    completion_tokens = 0
    for k, result in enumerate(results):
        i = k // call.n
        answer = result.text if result is not None else ""
        choice = {"index": k, "text": (shown_prompt(call, i) if call.echo else "") + answer,
                  "logprobs": choice_logprobs(call, i, result, scores[i], tokenizer),
                  "finish_reason": result.finish_reason if result is not None else "length"}
        choice.update(call.token_id_fields(result.token_ids if result is not None else (), prompt=call.prompts[i]))
        choices.append(choice)
        completion_tokens += len(result.token_ids) if result is not None else 0
    return {"id": completion_id(), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "system_fingerprint": None,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chunk(cid: str, created: int, model: str, *, index: int = 0, text: str = "", logprobs: Any = None,
          finish_reason: str | None = None, usage: dict[str, int] | None = None,
          ids: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk; with ``usage`` the trailing usage chunk (no choices); ``ids``: the
    choice's ``token_ids`` (and, on the first chunk, ``prompt_token_ids``) when the client asked for them."""
    body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                            "system_fingerprint": None}
    if usage is not None:
        return {**body, "choices": [], "usage": usage}
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **(ids or {})}
    return {**body, "choices": [choice]}


async def prompt_scores(call: TextCompletionCall, engine: Any) -> list[TokenScores | None]:
    """Each prompt's scores where ``echo`` with ``logprobs`` asks for them (one ``ascore``), None elsewhere."""
    sequences = [call.prompts[i] for i in call.scored]
    found = await engine.ascore(sequences, [1] * len(sequences), call.logprobs) if sequences else []
    by_prompt: list[TokenScores | None] = [None] * len(call.prompts)
    for i, score in zip(call.scored, found, strict=True):
        by_prompt[i] = score
    return by_prompt


async def answer(call: Any, served: Any) -> Any:
    """The parsed call's answer through the one call path (:class:`engine.serve.shared.calls.Call`): one
    ``acomplete`` (and the echoed prompts' ``ascore``), whole, or one ``astream_complete`` as ``text_completion``
    chunks. An adapter's calls answer with the adapter's name, as vLLM's do."""
    c, engine = call.parsed, served.engine
    answering = served.adapter_of(c.model) or served.model_name
    if c.stream:
        return await _streamed(call, engine, answering)

    async def run() -> tuple[list[Any], list[Any]]:
        scores = await prompt_scores(c, engine)
        if not c.generates:
            return [None] * c.prompt_count, scores
        return await engine.acomplete(c.rows, **c.kwargs, prepared=call.prepared), scores

    return await call.whole(run, counted=lambda out: [r for r in out[0] if r is not None], body=lambda out:
                            completion_body(c, out[0], out[1], model=answering, tokenizer=engine.tokenizer))


async def _streamed(call: Any, engine: Any, answering: str) -> Any:
    c = call.parsed
    cid, created = completion_id(), int(time.time())
    unsent = [c.prompts[0]]  # the prompt's ids, until a chunk carries them

    def ids(token_ids: Sequence[int]) -> dict[str, list[int]]:
        """``return_token_ids``: the chunk's token ids (all of them in the closing chunk), and the prompt's in the
        first chunk."""
        return c.token_id_fields(token_ids, prompt=unsent.pop() if unsent else None)

    async def open_stream() -> tuple[Any, list[Any]]:
        stream = engine.astream_complete(c.prompts[0], **c.kwargs, prepared=call.prepared)
        if not c.echo:
            return stream, []
        echoed = choice_logprobs(c, 0, None, (await prompt_scores(c, engine))[0], engine.tokenizer, answer=False)
        return stream, [chunk(cid, created, answering, text=shown_prompt(c, 0), logprobs=echoed, ids=ids([]))]

    def events(part: Any) -> list[Any]:
        out = [chunk(cid, created, answering, text=part.delta, ids=ids([]))] if part.delta else []
        if part.result is not None:
            logprobs = choice_logprobs(c, 0, part.result, None, engine.tokenizer, prompt=False)
            out.append(chunk(cid, created, answering, logprobs=logprobs, finish_reason=part.result.finish_reason,
                             ids=ids(part.result.token_ids)))
            if c.include_usage:
                out.append(chunk(cid, created, answering, usage=usage(part.result)))
        return out

    return await call.stream(open_stream, events)
