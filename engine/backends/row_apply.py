"""Turning rule decisions into logits edits: the one piece every adapter (HF, vLLM V1, vLLM V2) shares.

Each step an adapter collects ``(logits row, rule set, eos id)`` for the rows that carry per-row rules, calls
:func:`decide` (which also notes "EOS was the top choice while banned" for min-length's meta, with one batched
max) and :func:`apply_decisions` (force / ban / bias as a few batched tensor writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.rules.base import Decision, RuleSet

FORCE = Decision(force_eos=True)
"""The decision for a row a batched rule (``RepeatBank``) ends now."""


def decide(logits: Any, rows: Sequence[tuple[int, RuleSet, int]]) -> list[tuple[int, int, Decision]]:
    """Each row's decision as ``(logits row, eos, decision)``; rows whose EOS is banned while it is the top
    choice of the unedited logits (ties included) get ``note_eos_suppressed()`` (checked until the first time it
    happens: one batched max over the vocabulary per step, a single device-to-host copy).

    >>> import torch
    >>> from engine.rules.min_length import MinLengthRule
    >>> rs = RuleSet([MinLengthRule(min_chars=5, max_chars=None, punctuation_bias=0.0, sentence_end_ids=())],
    ...              terminal_ids={0})
    >>> [d.ban_eos for _, _, d in decide(torch.tensor([[3.0, 1.0]]), [(0, rs, 0)])], rs.rules[0].eos_suppressed
    ([True], True)
    """
    decisions = [(index, eos, rules.decision(), rules) for index, rules, eos in rows]
    # Only rows that never had EOS on top yet: the meta is a yes/no, so one sighting settles it.
    banned = [(index, eos, rules) for index, eos, d, rules in decisions
              if d.ban_eos and not d.force_eos and not rules.eos_noted]
    if banned:
        import torch

        index = torch.tensor([i for i, _, _ in banned], device=logits.device)
        eos_ids = torch.tensor([eos for _, eos, _ in banned], device=logits.device)
        # A max (not an argmax: several times cheaper on CPU) of the unedited rows; EOS is on top when it reaches
        # it (a tie counts). Gathering the rows first copies them; past half the batch one max over all reads less.
        top = logits.amax(dim=-1)[index] if 2 * len(banned) >= logits.shape[0] else logits[index].amax(dim=-1)
        for (_, _, rules), on_top in zip(banned, (logits[index, eos_ids] >= top).tolist(), strict=True):
            if on_top:
                rules.note_eos_suppressed()
    return [(index, eos, d) for index, eos, d, _ in decisions]


def apply_decisions(logits: Any, decisions: Sequence[tuple[int, int, Decision]]) -> Any:
    """Apply force / ban / bias to ``logits`` (num_rows, vocab) in place; returns it.

    What another processor already masked (a grammar of structured outputs, applied before the rules on every
    backend) is never undone, and no row is left without a token: a forced EOS that is masked waits (the row goes
    on as the mask allows; its rule forces again at the next step, until the grammar allows EOS), and EOS is not
    banned from a row where it is the only token still allowed (vLLM's own min-tokens restores such rows too).

    >>> import torch
    >>> logits = torch.zeros(3, 4)
    >>> _ = apply_decisions(logits, [(0, 1, Decision(force_eos=True)), (2, 1, Decision(ban_eos=True, bias={3: .5}))])
    >>> logits.tolist()
    [[-inf, 0.0, -inf, -inf], [0.0, 0.0, 0.0, 0.0], [0.0, -inf, 0.0, 0.5]]
    >>> inf = float("inf")
    >>> masked = torch.tensor([[0.0, -inf, 1.0], [-inf, 2.0, -inf]])  # row 0: EOS (1) masked; row 1: EOS only
    >>> apply_decisions(masked, [(0, 1, Decision(force_eos=True)), (1, 1, Decision(ban_eos=True))]).tolist()
    [[0.0, -inf, 1.0], [-inf, 2.0, -inf]]
    """
    import torch

    force = [(i, eos) for i, eos, d in decisions if d.force_eos]
    ban = [(i, eos) for i, eos, d in decisions if d.ban_eos and not d.force_eos]
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, _eos, d in decisions:
        if d.bias and not d.force_eos:
            bias_rows.extend([i] * len(d.bias))
            bias_cols.extend(d.bias.keys())
            bias_vals.extend(d.bias.values())
    device = logits.device
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device)),
                          torch.tensor(bias_vals, device=device, dtype=logits.dtype), accumulate=True)
    if ban:
        rows, cols = (torch.tensor(x, device=device) for x in zip(*ban, strict=True))
        saved = logits[rows, cols].clone()
        logits[rows, cols] = float("-inf")
        # EOS was the only token allowed (a grammar's end): banning it would leave nothing to sample.
        emptied = torch.isinf(logits[rows].amax(dim=-1)) & ~torch.isinf(saved)
        logits[rows[emptied], cols[emptied]] = saved[emptied]
    if force:
        rows, cols = (torch.tensor(x, device=device) for x in zip(*force, strict=True))
        allowed = ~torch.isinf(logits[rows, cols])  # a masked EOS stays masked: the force waits for the grammar
        rows, cols = rows[allowed], cols[allowed]
        logits[rows] = float("-inf")
        logits[rows, cols] = 0.0
    return logits
