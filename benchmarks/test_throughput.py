"""Throughput matrix: backend x batch x prompt length x output length x guard set, at fixed output length.

Each case measures two variants interleaved in one run and records their ratio:

* guard set ``none``: the engine vs the raw backend call with identical prompt ids and settings
  (HF ``model.generate``; vLLM ``LLM.generate`` on a bare ``LLM`` built with the engine's own arguments)
  -> ``engine_over_raw``;
* ``repeat`` / ``min_length``: the engine with the guard vs without it -> ``guard_on_over_off``, and what the
  guard adds per decode step of the batch (median difference / new tokens) -> ``added_ms_per_step``.

EOS is held back (``min_new_tokens == max_new_tokens``), so every round generates exactly
``batch x new_tokens`` tokens; the test asserts it, so a variant that stopped early cannot flatter a ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import MIN_LENGTH, batch_messages, fixed_length

QUICK_BATCHES = 8
"""The release gate reads every case's ratio; CI's quick tier (``gated``) measures the batches up to this one, the
largest batch (64 at smoke size: about 100 s of CI's 2-core run with its warm-up) only in the full tier
(``gated_full``), where its ``engine_over_raw`` is gated as every other."""


@dataclass(frozen=True)
class Case:
    backend: str
    batch: int
    prompt_len: str
    new_tokens: int
    guard_set: str

    @property
    def id(self) -> str:
        return f"{self.backend}-b{self.batch}-{self.prompt_len}-o{self.new_tokens}-{self.guard_set}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    if bench is None:  # not opted in: one placeholder case, skipped by the conftest
        cases = [Case("hf", 1, "short", 16, "none")]
    else:
        s = bench.size
        cases = [Case(b, n, p, o, g) for b in bench.backends for n in s.batches for p in s.prompt_lens
                 for o in s.new_tokens for g in s.guard_sets if g == "none" or n in s.guard_batches]
    params = [pytest.param(c, id=c.id, marks=pytest.mark.gated if c.batch <= QUICK_BATCHES else pytest.mark.gated_full)
              for c in cases]
    metafunc.parametrize("case", params)


def raw_hf(engine: Any, messages: list[Any], options: dict[str, Any]) -> Variant:
    import torch

    rendered, plan = engine.prepare(messages, options=options)
    backend = engine.backend
    ids, mask = backend._left_pad([r.token_ids for r in rendered])
    config = backend.generation_config(plan)

    def run() -> int:
        with torch.inference_mode():
            out = backend.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        sequences = getattr(out, "sequences", out)  # the engine's config may ask for a dict output
        return int(sequences[:, ids.shape[1]:].numel())

    return Variant("raw", "reference", run)


def raw_vllm(engine: Any, llm: Any, messages: list[Any], options: dict[str, Any]) -> Variant:
    from vllm.inputs import TokensPrompt

    rendered, plan = engine.prepare(messages, options=options)
    params = engine.backend.sampling_params(plan)
    prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in rendered]

    def run() -> int:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return Variant("raw", "reference", run)


def through_engine(name: str, role: str, engine: Any, messages: list[Any], options: dict[str, Any],
                   plugins: list[dict[str, Any]] | None = None) -> Variant:
    def run() -> int:
        return sum(len(r.token_ids) for r in engine.generate(messages, options=options, plugins=plugins))

    return Variant(name, role, run)


def test_throughput(bench, benchmark, case: Case) -> None:
    messages = batch_messages(case.batch, case.prompt_len)
    options = fixed_length(case.new_tokens)
    plain = bench.engine(case.backend)
    if case.guard_set == "none":
        reference = (raw_hf(plain, messages, options) if case.backend == "hf"
                     else raw_vllm(plain, bench.raw_vllm(), messages, options))
        subject = through_engine("engine", "subject", plain, messages, options)
        ratio_name = "engine_over_raw"
    elif case.guard_set == "repeat":
        reference = through_engine("engine", "reference", plain, messages, options)
        subject = through_engine("engine+repeat", "subject", bench.engine(case.backend, guarded=True), messages,
                                 options)
        ratio_name = "guard_on_over_off"
    elif case.guard_set == "min_length":
        reference = through_engine("engine", "reference", plain, messages, options)
        subject = through_engine("engine+min_length", "subject", plain, messages, options, plugins=MIN_LENGTH)
        ratio_name = "guard_on_over_off"
    else:
        raise AssertionError(f"unknown guard set {case.guard_set!r}")

    rounds = bench.measure(benchmark, case.id, [reference, subject], gates={ratio_name: (subject.name, reference.name)})
    expected = case.batch * case.new_tokens
    for variant in (reference, subject):  # fixed length: a variant that stopped early would flatter the ratio
        assert rounds.tokens(variant.name) == {expected}, (variant.name, rounds.tokens(variant.name), expected)
    rendered, _ = plain.prepare(messages, options=options)
    figures = {ratio_name: rounds.speed_ratio(subject.name, reference.name)}
    if case.guard_set != "none":  # the adapter's cost per decode step of the whole batch
        added = rounds.median_wall(subject.name) - rounds.median_wall(reference.name)
        figures["added_ms_per_step"] = added / case.new_tokens * 1e3
    bench.record({"benchmark": f"throughput[{case.id}]", "group": "throughput", "backend": case.backend,
                  "batch": case.batch, "prompt_len": case.prompt_len,
                  "prompt_tokens": sum(len(r.token_ids) for r in rendered), "new_tokens": case.new_tokens,
                  "fixed_length": True, "guard_set": case.guard_set},
                 rounds, figures, benchmark)
