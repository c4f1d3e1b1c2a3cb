"""Rule events that lie past a row's returned tokens do not count.

Every rule event carries the position it decided: the number of tokens the rule had seen, which is the index in the
generated ids of the token its decision shaped (the forced EOS of a trigger, the token chosen while EOS was held
back). A backend may run a row's rules beyond the ids it returns: vLLM's async scheduling (the default on CUDA)
decodes a finished row one more step, and after a stop string (found in the frontend) the engine core keeps
decoding until the abort lands. An event at or past ``len(ids)`` shaped no returned token, so the row was not ended
or held back by it: its flag, its meta and its trigger count are dropped here, once, for every backend.

>>> events_within({"repeat_terminate": ("ngram_repeats", 7), "json_boundary_closed": True,
...                "json_boundary_closed_at": 3}, generated=5)
{'json_boundary_closed': True, 'json_boundary_closed_at': 3}
>>> events_within({"repeat_terminate": ("ngram_repeats", 4)}, generated=5)
{'repeat_terminate': ('ngram_repeats', 4)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FLAG_POSITIONS = {"json_boundary_closed": "json_boundary_closed_at", "min_length_capped": "min_length_capped_at",
                  "min_length_eos_suppressed": "min_length_eos_suppressed_at"}
"""A flag event -> the event holding its position (None while the flag is False)."""


def event_position(name: str, events: Mapping[str, Any]) -> int | None:
    """Where event ``name`` happened (tokens seen by its rule), or None when it has no position."""
    if name == "repeat_terminate":
        return int(events[name][1])
    if name in FLAG_POSITIONS and events.get(FLAG_POSITIONS[name]) is not None:
        return int(events[FLAG_POSITIONS[name]])
    return None


def events_within(events: Mapping[str, Any], *, generated: int) -> dict[str, Any]:
    """``events`` without those whose position is ``generated`` or later (the row returned ``generated`` ids):
    a dropped trigger is removed, a dropped flag reads False with no position."""
    kept: dict[str, Any] = dict(events)
    if "repeat_terminate" in kept and event_position("repeat_terminate", kept) >= generated:
        del kept["repeat_terminate"]
    for flag, at in FLAG_POSITIONS.items():
        position = event_position(flag, kept)
        if position is not None and position >= generated:
            kept[flag], kept[at] = False, None
    return kept


def stopped_on_seen_token(events: Mapping[str, Any]) -> dict[str, Any]:
    """The events of rules run as a stopping criterion (HF ``stopping_criteria``, llama.cpp's stoppers): the row
    stops on the token the rule had just seen, so the token its decision shaped is that one, one before the tokens
    seen (a logits-processor rule shapes the next token instead). Only ``json_boundary`` runs this way.

    >>> stopped_on_seen_token({"json_boundary_closed": True, "json_boundary_closed_at": 4})
    {'json_boundary_closed': True, 'json_boundary_closed_at': 3}
    """
    shifted = dict(events)
    for at in FLAG_POSITIONS.values():
        if shifted.get(at) is not None:
            shifted[at] = int(shifted[at]) - 1
    return shifted


def repeat_meta(events: Mapping[str, Any]) -> dict[str, Any]:
    """The repeat guard's per-row report, read from its own event (never from a finish reason): what every result's
    meta and every rollout envelope carries, the engine's and the ms-swift plugin's alike.

    >>> repeat_meta({"repeat_terminate": ("ngram_repeats", 7)})
    {'repeat_terminate_triggered': 1, 'repeat_terminate_index': 7, 'repeat_terminate_reason': 'ngram_repeats'}
    >>> repeat_meta({})["repeat_terminate_triggered"]
    0
    """
    event = events.get("repeat_terminate")
    return {"repeat_terminate_triggered": int(event is not None),
            "repeat_terminate_index": int(event[1]) if event else None,
            "repeat_terminate_reason": event[0] if event else None}
