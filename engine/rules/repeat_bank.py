"""The id-only repeat rule for many rows at once: the pure rule's own O(1) algorithm, as numpy array operations.

:class:`engine.rules.repeat.RepeatRule` is the executable spec, fed one token per row per step in Python. An
adapter that sees a whole batch each step (HF's logits processor) hands :class:`RepeatBank` the step's new
token of every row instead: a dozen array operations per step whatever the batch size, on the host (a
device-side version paid about 230 µs of kernel launches per step on an H100, more than Python per row below
batch 64). Rules that read text (``max_object_keys``) stay with the spec.

The bank mirrors the spec exactly (a property test checks fire index and reason): per row a ring of the last
``max(1, n)`` tokens and two run counters, ``run1`` (tokens equal to the one before) and ``runN`` (equal to the
one ``n`` before); the tail of length ``L`` is ``p``-periodic exactly when ``run_p >= L - p``. It fires once
``run1 >= N - 1`` (consecutive, checked first) or ``runN >= n (r - 1)`` (n-gram), not before
``min_new_tokens`` tokens, at most once, and never after the row emitted a terminal id (which it does not count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from engine.rules.base import RuleSpec
from engine.rules.repeat import CONSECUTIVE, NGRAM, RepeatThresholds

REASONS = {1: CONSECUTIVE, 2: NGRAM}


def vectorizable(thresholds: RepeatThresholds) -> bool:
    """Whether the thresholds read ids only (``max_object_keys`` needs the text).

    >>> vectorizable(RepeatThresholds(ngram_size=3, ngram_repeats=2)), vectorizable(RepeatThresholds(max_object_keys=3))
    (True, False)
    """
    return not thresholds.needs_text


def split_vectorizable(specs: Sequence[RuleSpec]) -> tuple[list[RepeatThresholds], list[RuleSpec]]:
    """(thresholds of the id-only repeat rules, the other specs): adapters run the first in a bank. Which specs are
    id-only was decided when they were made (``RuleSpec.bank``); nothing is built here.

    >>> from engine.rules.repeat import RepeatRule
    >>> spec = RepeatRule.spec(RepeatThresholds(max_consecutive_token_repeats=3))
    >>> [t.max_consecutive_token_repeats for t in split_vectorizable([spec])[0]]
    [3]
    """
    vector, rows = [], []
    for spec in specs:
        if spec.bank:
            vector.append(RepeatThresholds(**spec.params["thresholds"]))
        else:
            rows.append(spec)
    return vector, rows


class RepeatBank:
    """Repeat state of many rows, indexed by row (a batch index or a request slot); grows on demand.

    >>> bank = RepeatBank()
    >>> for row in (0, 1):
    ...     bank.assign(row, RepeatThresholds(max_consecutive_token_repeats=2), terminal_ids=[0])
    >>> bank.push([0, 1], [5, 7]).tolist()
    [False, False]
    >>> bank.push([0, 1], [5, 8]).tolist()
    [True, False]
    >>> bank.events(0), bank.events(1)
    ({'repeat_terminate': ('consecutive_token_repeats', 2)}, {})
    """

    def __init__(self) -> None:
        self.width = 1  # ring length: the longest period of any row
        self.term_width = 1
        self._positions: dict[int, np.ndarray] = {}  # np.arange(n) by n (a dict: not a per-row array)
        self._alloc(0)

    def _alloc(self, rows: int) -> None:
        self.ring = np.zeros((rows, self.width), dtype=np.int64)
        self.terminal = np.full((rows, self.term_width), -1, dtype=np.int64)
        for name in ("count", "run1", "run_n", "n_rep", "n", "span", "min_new"):
            setattr(self, name, np.zeros(rows, dtype=np.int64))
        self.live = np.zeros(rows, dtype=bool)  # assigned, and no terminal id seen yet
        self.fired_at = np.full(rows, -1, dtype=np.int64)  # tokens seen when it fired; -1: not fired
        self.reason = np.zeros(rows, dtype=np.int8)

    def _grow(self, rows: int, width: int, term_width: int) -> None:
        old = {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}
        old_width, old_rows = self.width, len(self.count)
        self.width, self.term_width = width, term_width
        self._alloc(rows)
        for name, array in old.items():
            if name == "ring":
                continue
            target = getattr(self, name)
            if array.ndim == 1:
                target[:old_rows] = array
            else:
                target[:old_rows, : array.shape[1]] = array
        for row in range(old_rows):  # re-lay each ring: its last min(count, old_width) tokens, in order
            count = int(self.count[row])
            for back in range(1, min(count, old_width) + 1):
                self.ring[row, (count - back) % width] = old["ring"][row, (count - back) % old_width]

    def assign(self, row: int, thresholds: RepeatThresholds, *, terminal_ids: Iterable[int]) -> None:
        """(Re)start ``row`` with these thresholds: nothing fed, nothing fired."""
        if not vectorizable(thresholds):
            raise ValueError("max_object_keys reads text; use engine.rules.repeat.RepeatRule for it")
        terminal = sorted(set(terminal_ids))
        n = thresholds.ngram_size if thresholds.ngram_repeats is not None else None
        need = (max(row + 1, len(self.count)), max(self.width, n or 1), max(self.term_width, len(terminal), 1))
        if need != (len(self.count), self.width, self.term_width):
            self._grow(max(need[0], 2 * len(self.count)), need[1], need[2])
        self.count[row] = self.run1[row] = self.run_n[row] = 0
        self.n_rep[row] = thresholds.max_consecutive_token_repeats or 0
        self.n[row] = n or 0
        self.span[row] = n * (thresholds.ngram_repeats - 1) if n else 0
        self.min_new[row] = thresholds.min_new_tokens
        self.terminal[row] = -1
        self.terminal[row, : len(terminal)] = terminal
        self.live[row] = True
        self.fired_at[row] = -1
        self.reason[row] = 0

    def copy_row(self, src: int, dst: int) -> None:
        """Make ``dst`` an exact copy of ``src`` (the batch moved a request)."""
        self.reserve(max(src, dst) + 1)
        for array in (v for v in vars(self).values() if isinstance(v, np.ndarray)):
            array[dst] = array[src]

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (the batch swapped two requests)."""
        self.reserve(max(a, b) + 1)
        for array in (v for v in vars(self).values() if isinstance(v, np.ndarray)):
            array[[a, b]] = array[[b, a]]

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows (new rows unassigned)."""
        if rows > len(self.count):
            self._grow(max(rows, 2 * len(self.count)), self.width, self.term_width)

    def release(self, row: int) -> None:
        """The row's request left: it takes no more tokens (its events stay readable until reassigned)."""
        if row < len(self.live):
            self.live[row] = False

    def push(self, rows: Any, tokens: Any) -> np.ndarray:
        """Feed each of ``rows`` its next generated token; returns which of them fire now (aligned with rows).

        ``rows=None`` means rows ``0 .. len(tokens) - 1`` (a whole HF batch): read through views, not gathers.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        sel: Any = slice(0, len(tokens)) if rows is None else np.asarray(rows, dtype=np.int64)
        if rows is None:
            self.reserve(len(tokens))
        fire_out = np.zeros(len(tokens), dtype=bool)
        ended = (self.terminal[sel] == tokens[:, None]).any(axis=1)
        pushed = self.live[sel] & ~ended
        if ended.any():
            self.live[sel] &= ~ended
        index = self._index(len(tokens)) if rows is None else sel  # integer positions, for the 2-D ring
        if pushed.all():
            where: Any = slice(None)
            r, t = index, tokens
        elif pushed.any():
            where = np.flatnonzero(pushed)
            sel = r = index[where]
            t = tokens[where]
        else:
            return fire_out
        count, n, width = self.count[sel], self.n[sel], self.width
        same1 = (count >= 1) & (t == self.ring[r, (count - 1) % width])
        same_n = (n > 0) & (count >= n) & (t == self.ring[r, (count - np.maximum(n, 1)) % width])
        run1 = np.where(same1, self.run1[sel] + 1, 0)
        run_n = np.where(same_n, self.run_n[sel] + 1, 0)
        self.run1[sel], self.run_n[sel] = run1, run_n
        self.ring[r, count % width] = t
        count += 1
        self.count[sel] = count
        n_rep = self.n_rep[sel]
        consecutive = (n_rep > 0) & (run1 >= n_rep - 1)
        ngram = (n > 0) & (run_n >= self.span[sel])
        fire = (consecutive | ngram) & (count >= self.min_new[sel]) & (self.fired_at[sel] < 0)
        if fire.any():
            fired = r[fire]
            self.fired_at[fired] = count[fire]
            self.reason[fired] = np.where(consecutive[fire], 1, 2)
            fire_out[np.arange(len(tokens))[where][fire]] = True
        return fire_out

    def has_fired(self, rows: Any) -> np.ndarray:
        """Which of ``rows`` have fired (at this step or before): their EOS stays forced until it lands, since a
        grammar may mask it for a while (``row_apply.apply_decisions``)."""
        return self.fired_at[np.asarray(rows, dtype=np.int64)] >= 0

    def _index(self, rows: int) -> np.ndarray:
        if rows not in self._positions:
            self._positions = {rows: np.arange(rows)}
        return self._positions[rows]

    def events(self, row: int) -> dict[str, Any]:
        """The row's events, as :meth:`RepeatRule.events` reports them."""
        fired_at = int(self.fired_at[row])
        return {"repeat_terminate": (REASONS[int(self.reason[row])], fired_at)} if fired_at >= 0 else {}
