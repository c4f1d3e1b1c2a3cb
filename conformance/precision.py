"""How far two backends' log-probabilities may differ below float32, calibrated in the same run on the same machine.

A fixed bound tuned on one host is not a rule: bfloat16 kernels differ by instruction set (AVX-512-BF16, AMX, AVX2
only), and a bound of 0.25 that held on one machine failed at 0.33 on the next. So each backend's own low-precision
error is measured where it runs: its logprobs in the run's dtype against its own float32 logprobs on the same tokens
(the float32 engine re-scores the low-precision rows teacher-forced). Then, for a token both backends report at the
same step of the same context, the triangle inequality gives the bound

    |A_low - B_low| <= |A_low - A_fp32| + |A_fp32 - B_fp32| + |B_fp32 - B_low|
                    <= own_A.worst      + REFERENCE_TOL     + own_B.worst

where ``REFERENCE_TOL`` is what float32 holds the two backends to (the main session proves it). A difference past it
means the backends compute different distributions, which no rounding explains. A token in one side's top-k only
must likewise lie within the bound of the other side's k-th value (a near-tie at the edge).

>>> a = OwnError("a", worst=0.1, compared=4, where="request 0 step 1 token 7")
>>> b = OwnError("b", worst=0.2, compared=4, where="request 0 step 0 token 3")
>>> round(value_bound(a, b), 4)
0.301
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

REFERENCE_TOL = 1e-3
"""Two backends' float32 log-probabilities of the same token at the same step (the main session's value bound)."""


@dataclass(frozen=True)
class OwnError:
    """One backend's low-precision error, measured in this run: the largest |low - float32| over every (request,
    step, token) that both its low-precision rows and its float32 re-score report, and where it was."""

    backend: str
    worst: float
    compared: int
    where: str

    def line(self) -> str:
        return f"{self.backend} own error {self.worst:.3g} over {self.compared} values (largest at {self.where})"


def own_error(backend: str, low: Sequence[Sequence[Mapping[int, float]]],
              reference: Sequence[Sequence[Mapping[int, float]]]) -> OwnError:
    """``backend``'s own error: ``low[i][step]`` is its top-k at that step of request ``i`` in the run's dtype,
    ``reference[i][step]`` its float32 values at the same step of the same tokens (a re-score's top alternatives).
    Tokens only one side reports are not compared; a calibration that compares nothing is refused.

    >>> own_error("a", [[{5: -0.1, 6: -2.5}]], [[{5: -0.12, 6: -2.4, 9: -3.0}]]).worst
    0.1
    """
    worst, compared, where = 0.0, 0, "nowhere"
    assert len(low) == len(reference), f"{backend}: {len(low)} low-precision rows, {len(reference)} re-scored"
    for i, (rows, refs) in enumerate(zip(low, reference, strict=True)):
        assert len(rows) <= len(refs), f"{backend} request {i}: {len(rows)} steps, only {len(refs)} re-scored"
        for step, (lp, ref) in enumerate(zip(rows, refs, strict=False)):
            for token in set(lp) & set(ref):
                diff = abs(lp[token] - ref[token])
                compared += 1
                if diff > worst:
                    worst, where = diff, f"request {i} step {step} token {token}"
    assert compared, f"{backend}: no token of its low-precision rows was re-scored in float32; nothing calibrated"
    return OwnError(backend, round(worst, 6), compared, where)


def value_bound(own_a: OwnError, own_b: OwnError, reference_tol: float = REFERENCE_TOL) -> float:
    """What the two backends' low-precision values of one token may differ by (the module's inequality)."""
    return own_a.worst + own_b.worst + reference_tol


def assert_top_k_close(la: Mapping[int, float], lb: Mapping[int, float], *, bound: float, what: str,
                       name_a: str, name_b: str) -> float:
    """One step's top-k of two backends on the same context: every token both report within ``bound``; a token
    one side reports alone is within ``bound`` of the other side's smallest value (it may only be a near-tie at
    the edge of the other's top-k). Returns the largest difference of a shared token.

    >>> assert_top_k_close({1: -0.1, 2: -2.0}, {1: -0.2, 3: -2.05}, bound=0.3, what="s", name_a="a", name_b="b")
    0.1
    >>> assert_top_k_close({1: -0.1, 2: -1.0}, {1: -0.2, 3: -2.05}, bound=0.3, what="s", name_a="a",
    ...                    name_b="b")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: s token 2: in a's top-k only at -1, 1.05 above b's smallest -2.05 (bound 0.3)...
    """
    worst = 0.0
    for token in set(la) & set(lb):
        diff = abs(la[token] - lb[token])
        assert diff <= bound, (f"{what} token {token}: {name_a}={la[token]:.4f} vs {name_b}={lb[token]:.4f}, "
                               f"{diff:.3g} apart (bound {bound:.3g})")
        worst = max(worst, diff)
    for own, other, name, other_name in ((la, lb, name_a, name_b), (lb, la, name_b, name_a)):
        edge = min(other.values())
        for token in set(own) - set(other):
            above = own[token] - edge
            assert above <= bound, (f"{what} token {token}: in {name}'s top-k only at {own[token]:.4g}, "
                                    f"{above:.3g} above {other_name}'s smallest {edge:.4g} (bound {bound:.3g})")
    return worst


def rescored(engine: Any, rows: Sequence[Any], top: int) -> list[tuple[dict[int, float], ...]]:
    """``engine``'s values at every generated step of ``rows`` (prompt ids + token ids, teacher-forced): per row and
    step, its ``top`` best tokens and the generated one (``engine.score``)."""
    sequences = [list(r.prompt_token_ids) + list(r.token_ids) for r in rows]
    starts = [len(r.prompt_token_ids) for r in rows]
    return [s.top or () for s in engine.score(sequences, starts, top=top)]
