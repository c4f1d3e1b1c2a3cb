"""The portable sampler on vLLM (``generation.sampler: portable``): the row processor draws, vLLM's sampler takes it.

vLLM runs a request's logits processors before its own penalty, temperature, min-p, top-k and top-p. A row that
draws portably carries its processing in ``extra_args`` (:func:`draw_args`); the processor (V1 or V2, after the
row's rules) computes the processed distribution with the shared steps (:func:`engine.rules.processing.process`,
the min-tokens ban first, as vLLM's own processor applies it), draws with :func:`engine.rules.portable_sampler.draw`
at the row's position, and leaves only the drawn token finite, so whatever vLLM's sampler does next returns it.

vLLM's processed logprobs would then describe that one-token row; the processor keeps the distribution the draw used
instead (top ``logprobs`` and the drawn token, per step, in the mode's form) among the row's events, and the backend
puts them in place of vLLM's (:func:`portable_logprobs`). Raw logprobs are vLLM's own: computed before any processor.
No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DRAW_KEY = "draw"
"""Where a row's portable draw travels inside ``extra_args.engine_rules``."""
LOGPROBS_EVENT = "portable_logprobs"
"""The row event that carries the draw's logprobs back to the engine (popped there, never reported)."""


def draw_args(plan: Any, seed: int, prompt_len: int) -> dict[str, Any] | None:
    """The ``draw`` entry of a row's ``extra_args`` (None: the row samples natively or is greedy).

    >>> from engine.backends.base import CallPlan
    >>> from engine.config import GenerationOptions, StopPolicy
    >>> plan = CallPlan(GenerationOptions(temperature=0.7, sampler="portable", seed=3), StopPolicy(), (2,))
    >>> draw_args(plan, 11, 5)["pos0"], draw_args(plan, 11, 5)["seed"]
    (4, 11)
    """
    opts = plan.options
    if not plan.draws_portably:
        return None
    return {"sampler": opts.sampler, "seed": seed, "pos0": prompt_len - 1, **plan.processing.as_dict(),
            "logprobs": opts.logprobs, "mode": plan.logprobs_mode}


def _draw_fields() -> dict[str, Any]:
    """What :func:`draw_args` writes, by type: the draw's own keys and every field of the carried processing."""
    import dataclasses

    from engine.rules.processing import Processing

    kinds = {"int": int, "float": (int, float)}
    return {"sampler": str, "seed": int, "pos0": int,
            **{f.name: kinds[str(f.type)] for f in dataclasses.fields(Processing)}}


DRAW_FIELDS = _draw_fields()


def check_draw_args(draw: Any, where: str) -> None:
    """``ValueError`` naming the field when ``draw`` is not what :func:`draw_args` builds.

    >>> check_draw_args({"sampler": "portable"}, "extra_args.engine_rules.draw")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: extra_args.engine_rules.draw lacks min_p, pos0, repetition_penalty, seed, temperature, top_k, ...
    """
    from engine.config.generation import SAMPLERS

    if not isinstance(draw, Mapping):
        raise ValueError(f"{where} must be a mapping (engine.backends.vllm.portable.draw_args), got {draw!r}")
    missing = sorted(set(DRAW_FIELDS) - set(draw))
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}; build it with engine.backends.vllm.portable.draw_args")
    for name, kind in DRAW_FIELDS.items():
        if not isinstance(draw[name], kind) or isinstance(draw[name], bool):
            raise ValueError(f"{where}.{name} has the wrong type: {draw[name]!r}")
    if draw["sampler"] not in SAMPLERS[1:]:
        raise ValueError(f"{where}.sampler must be one of {', '.join(SAMPLERS[1:])}, got {draw['sampler']!r}")


@dataclass
class PortableDraw:
    """One row's portable draw inside a vLLM processor; :meth:`step` once per decoding step.

    >>> import torch
    >>> args = {"sampler": "portable", "seed": 1, "pos0": 0, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
    ...         "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": 1, "mode": "processed_logprobs"}
    >>> d = PortableDraw.of(args, prompt=[0], terminal=[0], min_new=0)
    >>> row = torch.tensor([0.0, 1.0, 2.0])
    >>> d.step(row, []); int(torch.isfinite(row).sum()), len(d.recorded[0]) >= 1
    (1, True)
    """

    sampler: str
    seed: int
    pos0: int
    processing: Any
    prompt: tuple[int, ...]
    terminal: tuple[int, ...]
    min_new: int
    logprobs: int | None
    mode: str
    recorded: list[dict[int, float]] = field(default_factory=list)

    @classmethod
    def of(cls, args: Mapping[str, Any], *, prompt: Sequence[int], terminal: Sequence[int],
           min_new: int) -> PortableDraw:
        from engine.rules.processing import Processing

        processing = Processing.from_dict(args)
        return cls(sampler=str(args["sampler"]), seed=int(args["seed"]), pos0=int(args["pos0"]),
                   processing=processing, prompt=tuple(prompt), terminal=tuple(terminal), min_new=min_new,
                   logprobs=args.get("logprobs"), mode=str(args.get("mode") or "raw_logprobs"))

    def step(self, row: Any, output: Sequence[int]) -> None:
        """Draw this step's token from ``row`` (the row's logits after its rules, 1-D) and force it, in place."""
        import torch

        from engine.rules.portable_sampler import draw
        from engine.rules.processing import process

        generated = len(output)
        source = row.float()
        if generated < self.min_new and self.terminal:  # vLLM's min-tokens ban, which runs beside this processor
            source = source.clone()
            source[list(self.terminal)] = float("-inf")
        processed, _ = process(source, self.processing, [*self.prompt, *output])
        pick = draw(processed.cpu(), seed=self.seed, pos=self.pos0 + generated,
                    fp64=self.sampler == "portable_fp64").token
        if self.logprobs is not None and self.mode.startswith("processed"):
            self.recorded.append(_top(processed, pick, int(self.logprobs), logits=self.mode.endswith("logits")))
        kept = row[pick].clone()
        row.fill_(float("-inf"))
        row[pick] = kept if bool(torch.isfinite(kept)) else 0.0

    def events(self) -> dict[str, Any]:
        return {LOGPROBS_EVENT: list(self.recorded)} if self.recorded else {}


def _top(processed: Any, token: int, k: int, *, logits: bool) -> dict[int, float]:
    """The step's top-``k`` and the drawn ``token`` (vLLM's shape), from the processed row."""
    import torch

    values = processed.double() if logits else torch.log_softmax(processed.double(), dim=-1)
    entry: dict[int, float] = {}
    if k:
        top = torch.topk(values, k)
        entry = {int(t): float(v) for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)}
    entry[int(token)] = float(values[token])
    return entry


def portable_logprobs(events: dict[str, Any]) -> tuple[dict[int, float], ...] | None:
    """The draw's processed logprobs out of a row's collected ``events`` (removed from them), or None."""
    steps = events.pop(LOGPROBS_EVENT, None)
    if steps is None:
        return None
    return tuple({int(t): float(v) for t, v in dict(step).items()} for step in steps)
