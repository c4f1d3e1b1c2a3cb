"""What the guard did to a row, recomputed from the token ids vLLM returned: what a trainer reads to mask the token
the guard forced.

vLLM's answer says ``finish_reason "stop"`` for a row the guard ended, as for the model's own EOS. The guard's rules
are pure functions of the row's ids (and their text), so replaying them on the returned ids tells the two apart
exactly: the row was ended by the guard when the rules ask to end it after ``k`` tokens and the token at ``k`` is the
EOS (the last one). That token was forced, not sampled: mask it out of the loss and of the importance ratios (its
logprob is the processed distribution's, where every other token was -inf).

>>> report = guard_report([7, 7, 7, 2], {"repeat_terminate.max_consecutive_token_repeats": 3}, eos_id=2)
>>> report["repeat_terminate_triggered"], report["repeat_terminate_index"], report["forced_index"]
(1, 3, 3)
>>> guard_report([7, 8, 2], {"repeat_terminate.max_consecutive_token_repeats": 3}, eos_id=2)["forced_index"] is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.config.repeat import RepeatTerminateConfig
from engine.rules.base import RuleSet
from engine.vllm_plugin.settings import GuardSettings


def guard_report(token_ids: Sequence[int], extra_args: Mapping[str, Any] | None = None, *, eos_id: int,
                 server: RepeatTerminateConfig | None = None, min_tokens: int = 0,
                 decode: Callable[[Sequence[int]], str] | None = None) -> dict[str, Any]:
    """The guard's report for one returned row (``token_ids``: the completion's ids, EOS included when vLLM returned
    it), given the request's ``extra_args`` / ``vllm_xargs``, the server's subtree (``server``) and ``min_tokens``;
    ``decode`` (ids -> text) for the text-reading rules (``max_object_keys``, min-length).

    The keys of the engine's own per-row meta (``repeat_terminate_triggered``, ``repeat_terminate_index``, ``...
    _reason``), and ``forced_index``: the position of the token the guard forced (None: none was)."""
    settings = GuardSettings.resolve(extra_args, server=server)
    report: dict[str, Any] = {"repeat_terminate_triggered": 0, "repeat_terminate_index": None,
                              "repeat_terminate_reason": None, "forced_index": None}
    if settings is None:
        return report
    ends: tuple[int, ...] = ()
    if settings.needs_sentence_ends and decode is not None:
        ends = ()  # a bias changes which token is likeliest, never where the guard forces EOS
    rules = RuleSet([spec.build() for spec in settings.specs(min_tokens=min_tokens, sentence_end_ids=ends)],
                    terminal_ids=frozenset(), decode=decode, min_new_tokens=min_tokens)
    for k, token in enumerate(token_ids):
        if rules.decision().force_eos:
            if token == eos_id:
                report["forced_index"] = k
            break
        rules.feed(int(token))
    fired = rules.events().get("repeat_terminate")
    if fired and report["forced_index"] is not None and fired[1] == report["forced_index"]:
        report.update(repeat_terminate_triggered=1, repeat_terminate_reason=fired[0], repeat_terminate_index=fired[1])
    return report
