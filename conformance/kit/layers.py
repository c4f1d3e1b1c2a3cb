"""The first layer at which two records of the same case differ, in pipeline order: what an upgrade moved first.

A request goes through the pipeline in one order, and a change at one layer moves every layer after it, so a
change is named by the earliest layer that differs:

1. ``refusal``: one record refused the call (or refused it by another field) and the other did not;
2. ``template``: the rendered prompt's text (the chat template, its whitespace, a default system prompt);
3. ``tokenizer``: the prompt's token ids of the same rendered text (a normalizer, a merge, a special token);
4. ``ids``: the generated ids at a position both rows reached (the model, its kernels, its sampling);
5. ``logprobs``: the same ids, their top-k log-probabilities apart by more than the dtype's bound
   (``conformance.precision``'s rule: shared tokens within the bound, a token one side lists alone within the bound
   of the other's smallest);
6. ``ending``: the same ids as far as both go, but one row ends sooner, or with another finish or stop reason (an
   extra EOS id, a stop string, the guard);
7. ``text``: the same ids and ending, another ``text`` or ``raw_text`` (decoding, cleanup, post-decode plugins);
8. ``meta``: only the result's meta (the guard's trigger index, fallbacks, counts).

>>> old = {"error": "", "prompt_text": "<u>hi", "prompt_ids": [1, 2], "ids": [5, 6, 2], "top_ids": [],
...        "top_logprobs": [], "finish_reason": "stop", "stop_reason": "2", "text": "ab", "raw_text": "ab</s>",
...        "meta": "{}"}
>>> first_layer(old, dict(old, prompt_ids=[1, 3]))[0], first_layer(old, dict(old, ids=[5, 6]))[0]
('tokenizer', 'ending')
>>> first_layer(old, dict(old, ids=[5, 7, 2], text="ac"))
('ids', 'position 1: 6 -> 7')
>>> first_layer(old, old) is None
True
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

UNSEEDED = "unseeded"
"""A row sampled without a seed (the record's ``sampling``): its answer differs every run by design, so only the
layers before generation (refusal, template, tokenizer) are compared."""
LAYERS = ("refusal", "template", "tokenizer", "ids", "logprobs", "ending", "text", "meta")
"""Pipeline order (module doc)."""
FLOAT32_BOUND = 1e-3
"""The float32 bound between two records' log-probabilities: ``conformance.precision.REFERENCE_TOL``, what the
suite holds two backends to in float32."""
LOW_PRECISION_BOUND = 0.5
"""The bound below float32 when none is given: bfloat16's own error on the fixtures reaches about 0.3 (the run
calibrates its bound from it, ``conformance.precision``); a record keeps no such calibration, so a record compared in
bfloat16 is held to the calibrated bounds' largest value seen, rounded up."""


def bound_for(dtype: str) -> float:
    """The log-probability bound for records of ``dtype``.

    >>> bound_for("float32"), bound_for("bfloat16")
    (0.001, 0.5)
    """
    return FLOAT32_BOUND if dtype == "float32" else LOW_PRECISION_BOUND


def first_layer(old: Mapping[str, Any], new: Mapping[str, Any], *,
                bound: float = FLOAT32_BOUND) -> tuple[str, str] | None:
    """(layer, what differs there) for the earliest layer at which ``new`` differs from ``old``; None when equal."""
    if old["error"] or new["error"]:
        if old["error"] != new["error"]:
            return "refusal", f"{old['error'] or 'answered'} -> {new['error'] or 'answered'}"
        return None
    if old["prompt_text"] != new["prompt_text"]:
        return "template", "rendered prompt " + text_change(old["prompt_text"], new["prompt_text"])
    if list(old["prompt_ids"]) != list(new["prompt_ids"]):
        step = first_difference(old["prompt_ids"], new["prompt_ids"])
        return "tokenizer", f"prompt ids from position {step}: {list(old['prompt_ids'][step:step + 4])} -> " \
                            f"{list(new['prompt_ids'][step:step + 4])}"
    if UNSEEDED in (old.get("sampling"), new.get("sampling")):
        return None  # another answer every run: held to the last one up to its prompt only
    ids_old, ids_new = list(old["ids"]), list(new["ids"])
    step = first_difference(ids_old, ids_new)
    if step is not None and step < min(len(ids_old), len(ids_new)):
        return "ids", f"position {step}: {ids_old[step]} -> {ids_new[step]}" + top_k_at(old, new, step)
    logprobs = logprob_change(old, new, bound, min(len(ids_old), len(ids_new)))
    if logprobs:
        return "logprobs", logprobs
    if step is not None:
        longer = "new" if len(ids_new) > len(ids_old) else "old"
        return "ending", (f"{len(ids_old)} -> {len(ids_new)} ids ({longer} goes on with "
                          f"{(ids_new if longer == 'new' else ids_old)[step:step + 4]}), "
                          f"{old['finish_reason']}/{old['stop_reason']} -> {new['finish_reason']}/{new['stop_reason']}")
    if (old["finish_reason"], old["stop_reason"]) != (new["finish_reason"], new["stop_reason"]):
        return "ending", f"{old['finish_reason']}/{old['stop_reason']} -> {new['finish_reason']}/{new['stop_reason']}"
    for name in ("text", "raw_text"):
        if old[name] != new[name]:
            return "text", f"{name} " + text_change(old[name], new[name])
    if old["meta"] != new["meta"]:
        return "meta", meta_change(old["meta"], new["meta"])
    return None


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts); None when equal.

    >>> first_difference([1, 2], [1, 3]), first_difference([1], [1, 2]), first_difference("ab", "ab")
    (1, 1, None)
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def text_change(old: str, new: str, *, width: int = 24) -> str:
    """Where two texts part, with a little of each side.

    >>> text_change("Hello world", "Hello  world")
    "from character 6: 'world' -> ' world'"
    """
    at = first_difference(old, new) or 0
    return f"from character {at}: {old[at:at + width]!r} -> {new[at:at + width]!r}"


NEG_INF = -1e30
"""-inf (a token outside a processed distribution's support) as a finite value, so that two -inf compare equal and a
finite value against -inf compares far apart."""


def top_steps(row: Mapping[str, Any]) -> list[dict[int, float]]:
    """Per step, token id -> log-probability (-inf as :data:`NEG_INF`)."""
    return [{t: max(v, NEG_INF) for t, v in zip(ids, values, strict=True)}
            for ids, values in zip(row["top_ids"], row["top_logprobs"], strict=True)]


def top_k_at(old: Mapping[str, Any], new: Mapping[str, Any], step: int) -> str:
    """Both records' top-k at ``step``, where they were asked for."""
    a, b = top_steps(old), top_steps(new)
    if step >= len(a) or step >= len(b):
        return ""
    return f"; top-k old {_rounded(a[step])}, new {_rounded(b[step])}"


def _rounded(step: Mapping[int, float]) -> dict[int, float]:
    return {t: round(v, 4) for t, v in sorted(step.items(), key=lambda kv: -kv[1])}


def logprob_change(old: Mapping[str, Any], new: Mapping[str, Any], bound: float, steps: int) -> str:
    """The first step (of the first ``steps``) whose top-k differ beyond ``bound``, said; '' when none does, or when
    only one record asked for log-probabilities (that is a change of the check, seen in its call)."""
    from conformance.precision import assert_top_k_close

    a, b = top_steps(old), top_steps(new)
    for step in range(min(steps, len(a), len(b))):
        if not a[step] or not b[step]:
            continue
        try:
            assert_top_k_close(a[step], b[step], bound=bound, what=f"position {step}", name_a="old", name_b="new")
        except AssertionError as err:
            return str(err)
    return ""


def meta_change(old: str, new: str) -> str:
    """The meta keys whose values differ.

    >>> meta_change('{"a": 1, "b": 2}', '{"a": 1, "b": 3, "c": 0}')
    'b: 2 -> 3; c: None -> 0'
    """
    a, b = json.loads(old), json.loads(new)
    return "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
