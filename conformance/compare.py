"""Compare two backends' outputs on the same requests; failures name the backend, request, step and values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Divergence:
    request: int
    step: int
    token_0: int | None
    token_1: int | None


EXACT_IN_FP32 = frozenset({frozenset({"hf", "vllm"})})
"""Backend pairs whose float32 greedy token ids are asserted identical. Other pairs (llama.cpp's kernels against
HF's) are held to vLLM's rule (:func:`check_logprobs_close`), and how many prompts still matched exactly is reported."""
LOW_PRECISION_TOPK = 5
"""Log-probabilities the pool asks every engine for when the dtype is not float32 (``generation.logprobs``), so
that a divergence can be judged by vLLM's rule."""


def exact_pair(name_0: str, name_1: str, dtype: str) -> bool:
    """Whether ``name_0`` and ``name_1`` must agree token for token in ``dtype``.

    >>> exact_pair("hf", "vllm", "float32"), exact_pair("hf", "llamacpp", "float32"), exact_pair("hf", "vllm", "auto")
    (True, False, False)
    """
    return dtype == "float32" and frozenset({name_0, name_1}) in EXACT_IN_FP32


def divergence_steps(results_0: Sequence[Any], results_1: Sequence[Any]) -> list[int | None]:
    """Per request, the first step where the two backends' token ids differ (None: identical).

    >>> from types import SimpleNamespace as R
    >>> divergence_steps([R(token_ids=(1, 2)), R(token_ids=(3,))], [R(token_ids=(1, 5)), R(token_ids=(3,))])
    [1, None]
    """
    return [first_divergence(a.token_ids, b.token_ids) for a, b in zip(results_0, results_1, strict=True)]


def first_divergence(ids_0: Sequence[int], ids_1: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None when equal."""
    for step, (a, b) in enumerate(zip(ids_0, ids_1, strict=False)):
        if a != b:
            return step
    return None if len(ids_0) == len(ids_1) else min(len(ids_0), len(ids_1))


def describe(results_0: Sequence[Any], results_1: Sequence[Any], *, name_0: str, name_1: str,
             labels: Sequence[str], tokenizer: Any) -> list[str]:
    """One line per request whose token ids differ, with both continuations from the divergence."""
    lines = []
    for i, (r0, r1) in enumerate(zip(results_0, results_1, strict=True)):
        step = first_divergence(r0.token_ids, r1.token_ids)
        if step is None:
            continue
        tail_0 = tokenizer.decode(list(r0.token_ids[step: step + 8]))
        tail_1 = tokenizer.decode(list(r1.token_ids[step: step + 8]))
        lines.append(f"request {i} ({labels[i]}): diverges at step {step}: {name_0}={tail_0!r} vs {name_1}={tail_1!r}"
                     f"; common prefix {tokenizer.decode(list(r0.token_ids[:step]))!r}")
    return lines


def check_logprobs_close(*, outputs_0: Sequence[Any], outputs_1: Sequence[Any], name_0: str, name_1: str) -> None:
    """vLLM's rule: equal up to the first divergence, where each side's token is in the other's top-k."""
    for i, (r0, r1) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        close_at_divergence(r0, r1, what=f"request {i}", name_0=name_0, name_1=name_1)


def close_at_divergence(r0: Any, r1: Any, *, what: str, name_0: str, name_1: str) -> int | None:
    """vLLM's rule for one request: the step where the token ids first differ (None: identical), asserting that
    each side's token there is in the other's top-k log-probabilities. A row that is a strict prefix of the other
    fails: both saw the same tokens, so no tie can explain why one went on."""
    step = first_divergence(r0.token_ids, r1.token_ids)
    if step is None:
        return None
    assert step < min(len(r0.token_ids), len(r1.token_ids)), (
        f"{what}: {name_0} ({len(r0.token_ids)} tokens) and {name_1} ({len(r1.token_ids)}) agree on every shared "
        "token but one row went on")
    for name, r in ((name_0, r0), (name_1, r1)):
        assert r.logprobs is not None and len(r.logprobs) > step, (
            f"{what}: {name} returned no log-probabilities at step {step}; a low-precision comparison needs them "
            f"(the pool asks every engine for the top {LOW_PRECISION_TOPK} when the dtype is not float32)")
    t0, t1 = r0.token_ids[step], r1.token_ids[step]
    assert t0 in r1.logprobs[step], (f"{what} step {step}: {name_0} token {t0} not in {name_1} top-k "
                                     f"{sorted(r1.logprobs[step])}")
    assert t1 in r0.logprobs[step], (f"{what} step {step}: {name_1} token {t1} not in {name_0} top-k "
                                     f"{sorted(r0.logprobs[step])}")
    return step


RESULT_FIELDS = ("token_ids", "text", "raw_text", "finish_reason", "stop_reason")
BACKEND_OWN_META = ("backend",)  # meta that names the backend itself; every other key must agree


def assert_same_results(results: dict[str, Sequence[Any]], *, what: str, dtype: str) -> int:
    """Every side's results agree with the first's, by the rule of ``dtype``; returns how many requests diverged.

    float32: equal field by field (ids, texts, finish and stop reasons, meta except the backend's own name).
    Other dtypes (vLLM's rule for low precision, where rounding breaks near-ties differently per kernel and batch):
    a request whose token ids are identical is still equal on every field; one that diverges is equal up to the
    first divergence, where each side's token is in the other's top-k (:func:`close_at_divergence`), and past it
    nothing is compared, since each check asserts what its rule guarantees on every side's own rows. A failure
    names the request, the field and each side's value.

    >>> from types import SimpleNamespace as R
    >>> row = lambda ids, lp: R(token_ids=ids, text="", raw_text="", finish_reason="stop", stop_reason=None,
    ...                         meta={}, logprobs=lp)
    >>> tie = [{5: -0.7, 6: -0.7}, {7: -0.1}]
    >>> assert_same_results({"a": [row((5, 7), tie)], "b": [row((6, 7), tie)]}, what="x", dtype="bfloat16")
    1
    >>> assert_same_results({"a": [row((5, 7), tie)], "b": [row((6, 7), tie)]}, what="x", dtype="float32")
    Traceback (most recent call last):
    AssertionError: x: request 0 token_ids: a=(5, 7) vs b=(6, 7)
    """
    (name_0, first), *others = results.items()
    diverged = 0
    for name_1, second in others:
        assert len(first) == len(second), f"{what}: {name_0} gave {len(first)} results, {name_1} {len(second)}"
        for i, (r0, r1) in enumerate(zip(first, second, strict=True)):
            if dtype != "float32" and close_at_divergence(r0, r1, what=f"{what}: request {i}", name_0=name_0,
                                                          name_1=name_1) is not None:
                diverged += 1
                continue
            for field_name in RESULT_FIELDS:
                a, b = getattr(r0, field_name), getattr(r1, field_name)
                assert a == b, f"{what}: request {i} {field_name}: {name_0}={a!r} vs {name_1}={b!r}"
            meta_0 = {k: v for k, v in r0.meta.items() if k not in BACKEND_OWN_META}
            meta_1 = {k: v for k, v in r1.meta.items() if k not in BACKEND_OWN_META}
            assert meta_0 == meta_1, f"{what}: request {i} meta: {name_0}={meta_0!r} vs {name_1}={meta_1!r}"
    return diverged


def assert_served_equal(served: Sequence[Any], local: Sequence[Any], *, what: str, logprob_tol: float = 1e-4) -> None:
    """Results reached through the server equal the in-process ones: every field (prompt ids and the whole meta
    included); logprobs have the same token sets and values within ``logprob_tol`` (float noise of batching)."""
    assert len(served) == len(local), f"{what}: served {len(served)} results, in-process {len(local)}"
    for i, (s, r) in enumerate(zip(served, local, strict=True)):
        for field_name in (*RESULT_FIELDS, "prompt_token_ids"):
            a, b = getattr(s, field_name), getattr(r, field_name)
            assert a == b, f"{what}: request {i} {field_name}: served={a!r} vs in-process={b!r}"
        assert s.meta == r.meta, f"{what}: request {i} meta: served={s.meta!r} vs in-process={r.meta!r}"
        assert (s.logprobs is None) == (r.logprobs is None), f"{what}: request {i}: logprobs on one side only"
        for step, (ls, lr) in enumerate(zip(s.logprobs or (), r.logprobs or (), strict=True)):
            assert set(ls) == set(lr), f"{what}: request {i} step {step}: top-k ids {sorted(ls)} vs {sorted(lr)}"
            worst = max(0.0 if ls[k] == lr[k] else abs(ls[k] - lr[k]) for k in ls)  # -inf == -inf
            assert worst <= logprob_tol, f"{what}: request {i} step {step}: logprobs differ by {worst:.2e}"


ROLLOUT_TOKEN_BOUND = 2e-3
"""float32: the most a rollout token's logprob may be off the trainer's teacher-forced one."""
ROLLOUT_RATIO_BOUND = 0.01
"""float32: the most a sequence's log importance ratio (sum trainer - sum rollout) may be off 0."""


def check_rollout_band(got: Any, *, what: str, dtype: str, note: Any) -> None:
    """The training-inference mismatch of one rollout (``engine.trainer.mismatch.Mismatch``), written into the summary
    as ``what``; in float32 a bound: every token within :data:`ROLLOUT_TOKEN_BOUND`, every sequence's importance ratio
    within :data:`ROLLOUT_RATIO_BOUND`."""
    note(f"{what} ({dtype}, sampled): {got.line()}")
    if dtype == "float32":
        assert got.max < ROLLOUT_TOKEN_BOUND, f"{what}: a token's logprob is {got.max:.1e} off the trainer's"
        assert all(abs(x) < ROLLOUT_RATIO_BOUND for x in got.log_ratios), f"{what}: importance ratios {got.line()}"
