"""The HF adapter's row-finish recorder on tiny synthetic tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF adapter needs torch (installed by `nox -s tests`)")

from engine.backends.hf.backend import RowFinishRecorder  # noqa: E402
from engine.rules.detok import IncrementalDetokenizer  # noqa: E402
from engine.rules.stop import StopStringWatch  # noqa: E402

VOCAB = {0: "", 2: "", 5: "a", 6: "b", 7: "c", 9: "!"}


def watches(rows, min_new_tokens=0):
    """One real stop-string watch per row, on a tiny vocabulary where token 9 is the stop string "!"."""
    return [StopStringWatch(["!"], IncrementalDetokenizer(lambda ids: "".join(VOCAB[i] for i in ids)),
                            min_new_tokens=min_new_tokens) for _ in range(rows)]


def test_records_first_finish_per_row_and_keeps_finished_rows_done():
    rec = RowFinishRecorder(prompt_len=1, terminal_ids=[2], stop_watches=watches(3))
    assert rec(torch.tensor([[0, 5], [0, 2], [0, 5]]), None).tolist() == [False, True, False]
    assert rec(torch.tensor([[0, 5, 9], [0, 2, 2], [0, 5, 5]]), None).tolist() == [True, True, False]
    assert rec(torch.tensor([[0, 5, 9, 2], [0, 2, 2, 2], [0, 5, 5, 7]]), None).tolist() == [True, True, False]
    assert rec.lengths == [2, 1, None]


def test_stop_strings_wait_for_min_new_tokens():
    rec = RowFinishRecorder(prompt_len=1, terminal_ids=[2], stop_watches=watches(1, min_new_tokens=2))
    assert rec(torch.tensor([[0, 9]]), None).tolist() == [False]
    assert rec(torch.tensor([[0, 9, 9]]), None).tolist() == [False]
    assert rec(torch.tensor([[0, 9, 9, 9]]), None).tolist() == [True]
    assert rec.lengths == [3]


def test_on_token_hears_every_kept_token_and_nothing_after_a_row_ends():
    heard = []
    rec = RowFinishRecorder(prompt_len=1, terminal_ids=[2], stop_watches=watches(2),
                            on_token=lambda row, pos, tok: heard.append((row, pos, tok)))
    rec(torch.tensor([[0, 5], [0, 2]]), None)
    rec(torch.tensor([[0, 5, 9], [0, 2, 0]]), None)      # row 1 ended on EOS: its pad token is not heard
    rec(torch.tensor([[0, 5, 9, 0], [0, 2, 0, 0]]), None)  # row 0 ended on the stop string at position 1
    assert heard == [(0, 0, 5), (1, 0, 2), (0, 1, 9)]
    assert rec.lengths == [2, 1]


def test_on_token_returning_true_ends_the_row():
    rec = RowFinishRecorder(prompt_len=1, terminal_ids=[2],
                            on_token=lambda row, pos, tok: row == 1 and pos == 1)  # row 1's caller leaves
    assert rec(torch.tensor([[0, 5], [0, 6]]), None).tolist() == [False, False]
    assert rec(torch.tensor([[0, 5, 5], [0, 6, 6]]), None).tolist() == [False, True]
    assert rec.lengths == [None, 2]
