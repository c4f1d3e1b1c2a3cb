"""Turning rule decisions into logits edits: the one piece every adapter (HF, vLLM V1, vLLM V2) shares.

Each step an adapter collects ``(logits row, rule set, eos id)`` for the rows that carry per-row rules, calls
:func:`decide` (which also notes "EOS was the top choice while banned" for min-length's meta) and
:func:`apply_decisions` (force / ban / bias as a few batched tensor writes). Both questions that read a whole row
("is EOS on top?", "is EOS the only token left?") go through :func:`rows_with_a_logit_above`, which reads a first
block of the vocabulary and the rest only for the rows the block does not settle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.rules.base import Decision, RuleSet

FORCE = Decision(force_eos=True)
"""The decision for a row a batched rule (``RepeatBank``) ends now."""

SCAN_BLOCK = 1024
"""Vocabulary ids read first by :func:`rows_with_a_logit_above`. Byte-pair vocabularies give their most frequent
tokens the lowest ids, so while EOS is held back a token that beats it is nearly always among them (SmolLM2's real
logits along a text: the first 256 ids settled every row); a row the block settles costs 1/48 of SmolLM2's
49152-id read. Rows it does not settle are read whole: the answer is exact. 1024 rather than 256 for vocabularies
that start with 256 byte pieces (SentencePiece's byte fallback); 512, 1024 and 2048 cost alike at batch 64."""


def rows_with_a_logit_above(logits: Any, index: Any, floor: Any, *, block: int = SCAN_BLOCK) -> Any:
    """For each row ``logits[index[k]]``: is some logit strictly above ``floor[k]``? A bool tensor like ``index``
    (``index`` None: every row, in order).

    On CPU the rows are read in two passes, the first ``block`` ids of every row, then the rest of the rows that
    pass left open; on an accelerator, where the read is cheap and a host sync is not, in one.

    >>> import torch
    >>> logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [3.0, 0.0, 0.0, 7.0], [2.0, 1.0, 1.0, 1.0]])
    >>> rows_with_a_logit_above(logits, torch.tensor([0, 1, 2]), torch.tensor([4.0, 6.0, 2.0]), block=2).tolist()
    [True, True, False]
    """
    import torch

    whole = index is None or 2 * len(index) >= logits.shape[0]  # past half the batch one read of all rows is less

    def row_max(part: Any) -> Any:
        if index is None:
            return part.amax(dim=-1)
        return part.amax(dim=-1)[index] if whole else part[index].amax(dim=-1)

    if logits.device.type != "cpu" or block >= logits.shape[-1]:
        return row_max(logits) > floor
    above = row_max(logits[:, :block]) > floor
    if bool(above.all()):
        return above
    open_rows = torch.nonzero(~above).flatten()
    rows = open_rows if index is None else index[open_rows]
    above[open_rows] = logits[rows, block:].amax(dim=-1) > floor[open_rows]
    return above


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
        # EOS is on top of the unedited row when nothing beats it (a tie counts).
        beaten = rows_with_a_logit_above(logits, index, logits[index, eos_ids])
        for (_, _, rules), eos_beaten in zip(banned, beaten.tolist(), strict=True):
            if not eos_beaten:
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
        ban_eos(logits, *(torch.tensor(x, device=device) for x in zip(*ban, strict=True)))
    if force:
        rows, cols = (torch.tensor(x, device=device) for x in zip(*force, strict=True))
        allowed = ~torch.isinf(logits[rows, cols])  # a masked EOS stays masked: the force waits for the grammar
        rows, cols = rows[allowed], cols[allowed]
        logits[rows] = float("-inf")
        logits[rows, cols] = 0.0
    return logits


def ban_eos(logits: Any, rows: Any, cols: Any, *, beaten: Any = None) -> None:
    """Mask ``logits[rows[k], cols[k]]`` (each row's EOS) in place, except where it is the only token left.
    ``beaten`` (optional, bool per row): rows known to have a logit above their EOS, which therefore keep a token
    (only the others are read).

    >>> import torch
    >>> inf = float("inf")
    >>> logits = torch.tensor([[0.0, 1.0, 2.0], [-inf, 3.0, -inf]])
    >>> ban_eos(logits, torch.tensor([0, 1]), torch.tensor([1, 1])); logits.tolist()
    [[0.0, -inf, 2.0], [-inf, 3.0, -inf]]
    """
    import torch

    saved = logits[rows, cols]
    logits[rows, cols] = float("-inf")
    if beaten is not None:  # only rows where EOS was on top can be left with nothing
        if logits.device.type == "cpu" and bool(beaten.all()):
            return
        rows, cols, saved = rows[~beaten], cols[~beaten], saved[~beaten]
    # EOS was the only token allowed (a grammar's end): banning it would leave nothing to sample.
    emptied = ~torch.isinf(saved) & ~rows_with_a_logit_above(logits, rows, torch.full_like(saved, float("-inf")))
    if logits.device.type != "cpu" or bool(emptied.any()):
        logits[rows[emptied], cols[emptied]] = saved[emptied]


def ban_eos_in_every_row(logits: Any, eos: int) -> Any:
    """:func:`ban_eos` for every row with the same EOS id (the common step of a batch held back by min-length),
    through the column: returns, per row, whether EOS was on top of the unedited logits (a tie counts).

    >>> import torch
    >>> inf = float("inf")
    >>> logits = torch.tensor([[0.0, 1.0, 2.0], [-inf, 3.0, -inf], [0.0, 5.0, 1.0]])
    >>> ban_eos_in_every_row(logits, 1).tolist(), logits.tolist()
    ([False, True, True], [[0.0, -inf, 2.0], [-inf, 3.0, -inf], [0.0, -inf, 1.0]])
    """
    import torch

    beaten = rows_with_a_logit_above(logits, None, logits[:, eos])
    if logits.device.type == "cpu" and bool(beaten.all()):  # every row keeps a token: one column write
        logits[:, eos] = float("-inf")
    else:
        rows = torch.arange(logits.shape[0], device=logits.device)
        ban_eos(logits, rows, torch.full_like(rows, eos), beaten=beaten)
    return ~beaten
