"""HF sampling with a generator per row (the seeded-sampling contract, ``engine.rules.seeding``).

``generate(do_sample=True)`` draws every row from one ``torch.multinomial`` stream, so identical prompts in one
seeded call get different samples only by their position, and a row's sample changes with its batch-mates. The
HF backend therefore runs ``generate`` greedy and samples in its last logits processor: the call's processing
(``CallPlan.processing``, the shared steps of :func:`engine.rules.processing.warp` in vLLM's order: temperature, min-p,
top-k, top-p, after every other processor: HF's repetition penalty, min-length, row rules, grammar mask), then one draw
per row from that row's own ``torch.Generator``; the processor returns scores where only the drawn
token is finite, so greedy selection picks it. Raw logits (``output_logits``, raw logprobs' source) are untouched;
a :class:`ScoreTap` keeps the scores the draw used (processed logprobs' source, vLLM's ``processed_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.rules.processing import Processing


class RowSampler:
    """The last logits processor of a sampled HF call: warps, then draws each row with its own generator.

    It is handed the call's processing whole (``CallPlan.processing``: the steps after HF's repetition penalty) and
    its ``sampler``. ``seeds[i]`` seeds row ``i`` (None: that row draws from torch's global generator, i.e.
    unseeded)::

        >>> import torch
        >>> from engine.rules.processing import Processing
        >>> sampler = RowSampler([7, 7], Processing(temperature=1.0))
        >>> scores = sampler(torch.zeros(2, 1), torch.zeros(2, 50))  # two rows, a flat distribution
        >>> bool((scores[0] == scores[1]).all()), int(torch.isfinite(scores[0]).sum())  # same seed: same draw
        (True, 1)
    """

    def __init__(self, seeds: Sequence[int | None], processing: Processing, *, sampler: str = "native",
                 tap: ScoreTap | None = None, positions: Sequence[int] = ()) -> None:
        import torch

        self.processing = processing
        self.generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        self.tap = tap
        self.sampler = sampler
        self.seeds = list(seeds)
        self.positions = list(positions)
        """The portable sampler's position of each row's first draw: its last prompt token's (``prompt_len - 1``)."""
        self.step = 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        from engine.rules.processing import warp

        scores = warp(scores.clone(), self.processing)  # a copy: HF keeps this step's tensor as its raw logits
        if self.tap is not None:
            self.tap(input_ids, scores)
        if self.sampler != "native":
            return self._portable(scores)
        probs = torch.softmax(scores.float(), dim=-1).cpu()  # (batch, vocab); the generators live on the CPU
        drawn = torch.full_like(scores, float("-inf"))
        for row, generator in enumerate(self.generators):
            token = torch.multinomial(probs[row], 1, generator=generator)
            drawn[row, token.to(scores.device)] = 0.0
        return drawn

    def _portable(self, scores: Any) -> Any:
        """The shared counter-based draw (``engine.rules.portable_sampler``) of each row at its position."""
        import torch

        from engine.rules.portable_sampler import draw_rows

        rows = scores.float().cpu()
        positions = [p + self.step for p in self.positions]
        self.step += 1
        picks = draw_rows(rows, [int(s) for s in self.seeds], positions, fp64=self.sampler == "portable_fp64")
        drawn = torch.full_like(scores, float("-inf"))
        for row, pick in enumerate(picks):
            drawn[row, pick.token] = 0.0
        return drawn


class ScoreTap:
    """A logits processor that keeps a float32 copy of the scores it sees, one (batch, vocab) tensor per step, and
    passes them on unchanged: last in a greedy call, or inside :class:`RowSampler` after its warpers, it holds the
    distribution each token was drawn from (what vLLM's ``processed_logprobs`` report).

    >>> import torch
    >>> tap = ScoreTap()
    >>> _ = tap(torch.zeros(1, 1), torch.tensor([[1.0, float("-inf")]]))
    >>> tap.steps[0].tolist()
    [[1.0, -inf]]
    """

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.steps.append(scores.float().clone())
        return scores
