"""The llama.cpp adapter of the shared row rules: one row's logits step, in the shape of a ``logits_processor``.

The decoder (:mod:`engine.backends.llamacpp.sequences`) calls it once per generated token with ``(input_ids,
scores)`` (the ids so far and the row's logits in token-id order, a numpy view of llama.cpp's own buffer) before the
row's sampler draws from them. :class:`LlamaCppRowStep` is that callable for one row. It applies, in HF's order:
``min_new_tokens`` (terminal ids banned until then),
``repetition_penalty`` (HF's rule), the row's rules (the shared :class:`~engine.rules.base.RuleSet`, decided and
applied by :mod:`engine.backends.row_apply` on a zero-copy torch view of the row, exactly as on HF and vLLM), then
the temperature, min-p, top-k and top-p (then, with ``generation.sampler: portable``, the shared counter-based draw of
:mod:`engine.rules.portable_sampler`). The penalty, min-p and truncation are the shared rules of
:mod:`engine.rules.processing` (vLLM's order and rule), on the same view; llama.cpp's own
sampler then draws from exactly that (its top-k, top-p and min-p stay off). When logprobs are asked for it keeps
the row as the mode says: the raw scores before any edit (HF's ``output_logits``, vLLM's raw logprobs) or the
processed ones the draw used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.rules.base import RuleSet

if TYPE_CHECKING:
    from engine.config.generation import GenerationOptions
    from engine.rules.processing import Processing


class LlamaCppRowStep:
    """One row's logits processor; the backend's loop feeds it each kept token (:meth:`feed`).

    It reads what it needs from the call's options and processing, handed whole (``GenerationOptions``: the ban on
    terminal ids until ``min_new_tokens``, the portable draw when ``sampler`` asks for it; ``CallPlan.processing``: the
    penalty, then, after the rules, the shared steps of :func:`engine.rules.processing.warp`).

    >>> import numpy as np
    >>> from engine.config.generation import GenerationOptions
    >>> step = LlamaCppRowStep(prompt_len=1, terminal_ids=[0], rules=None, eos_id=0,
    ...                        options=GenerationOptions(max_new_tokens=4, min_new_tokens=1))
    >>> step(np.array([5]), np.zeros(3, dtype=np.float32)).tolist()
    [-inf, 0.0, 0.0]
    >>> step.feed(2); step(np.array([5, 2]), np.zeros(3, dtype=np.float32)).tolist()
    [0.0, 0.0, 0.0]
    """

    def __init__(self, *, prompt_len: int, terminal_ids: Sequence[int], rules: RuleSet | None, eos_id: int,
                 options: GenerationOptions, logprobs_mode: str = "raw_logprobs", seed: int | None = None,
                 processing: Processing | None = None) -> None:
        from engine.rules.processing import Processing

        self.prompt_len = prompt_len
        self.terminal_ids = list(terminal_ids)
        self.rules = rules
        self.eos_id = eos_id
        self.options = options
        self.min_new_tokens = options.min_new_tokens
        self.processing = processing if processing is not None else Processing.of(options)  # the plan's, in a call
        self.logprobs = options.logprobs is not None
        self.mode = logprobs_mode
        self.portable = None if options.is_greedy or options.sampler == "native" else (options.sampler, seed)
        """(sampler, row seed) when the row draws with the portable sampler: the step draws and leaves only the drawn
        token finite, so llama.cpp's greedy chain takes it."""
        self.generated = 0
        self.last_logprobs: Any = None
        """The latest step's row as ``logprobs_mode`` says (when ``logprobs``): raw or processed, log-softmaxed or
        as logits."""

    def feed(self, token: int) -> None:
        """The token llama.cpp just sampled for this row (the next call decides the token after it)."""
        self.generated += 1
        if self.rules is not None:
            self.rules.feed(token)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import numpy as np
        import torch

        from engine.rules.processing import penalize, warp

        if self.logprobs and self.mode.startswith("raw"):
            self.last_logprobs = self._kept(scores)
        row = torch.from_numpy(scores)  # (vocab,), shares memory with llama.cpp's array: every edit is in place
        if self.generated < self.min_new_tokens:
            scores[self.terminal_ids] = -np.inf
        if self.processing.repetition_penalty != 1.0:
            penalize(row, np.asarray(input_ids[: self.prompt_len + self.generated], dtype=np.int64).tolist(),
                     self.processing.repetition_penalty)
        if self.rules is not None and self.rules.rules:
            from engine.backends.row_apply import apply_decisions, decide

            apply_decisions(row[None, :], decide(row[None, :], [(0, self.rules, self.eos_id)]))
        warp(row[None, :], self.processing)  # temperature, min-p, top-k, top-p: the shared steps, in vLLM's order
        if self.logprobs and self.mode.startswith("processed"):
            self.last_logprobs = self._kept(scores)
        if self.portable is not None:
            from engine.rules.portable_sampler import draw

            sampler, seed = self.portable
            token = draw(scores, seed=seed, pos=self.prompt_len - 1 + self.generated,
                         fp64=sampler == "portable_fp64").token
            kept = scores[token]
            scores[:] = -np.inf
            scores[token] = kept
        return scores

    def _kept(self, scores: Any) -> Any:
        """A float64 copy of a row, log-softmaxed for the ``*_logprobs`` modes."""
        import numpy as np

        row = scores.astype(np.float64)
        if self.mode.endswith("logits"):
            return row
        shifted = row - float(row.max())
        return shifted - np.log(np.exp(shifted).sum())

    def top_logprobs(self, token: int, k: int) -> dict[int, float]:
        """The latest step's top-``k`` log-probabilities and the sampled ``token``'s (HF's and vLLM's shape)."""
        import numpy as np

        lp = self.last_logprobs
        entry: dict[int, float] = {}
        if k:
            top = np.argpartition(-lp, k - 1)[:k]
            entry = {int(t): float(lp[t]) for t in top[np.argsort(-lp[top], kind="stable")]}
        entry[int(token)] = float(lp[token])
        return entry
