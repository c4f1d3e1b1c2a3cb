"""The guard's vLLM plugin (``engine.vllm_plugin``) inside a bare ``vllm.LLM``, as a user adds it to the vLLM they run.

Two groups of cases, fixed length (EOS held back by ``min_tokens``: every round generates ``batch x new_tokens``
tokens, asserted), the engine's own vLLM arguments on both sides:

* ``idle``: the LLM with the plugin loaded but not asked (no ``extra_args``, no start-up activation) vs the same LLM
  without it -> ``plugin_idle_over_without``, gated at 0.99 (what installing the guard costs a deployment that
  does not use it), by the full tier's gate (``engine.report.gate.FULL_TIER_MINIMUMS``: CI's three rounds on two
  cores spread 8-36 %, too wide for a 1 % bar);
* ``repeat``: the plugin's LLM with the repeat guard asked per request (``extra_args``) vs not asked ->
  ``guard_on_over_off`` (the active guard's cost; healthy prompts, so it watches and never fires).
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import REPEAT_GUARD, batch_messages, fixed_length

pytestmark = pytest.mark.gated_full  # the full tier's gate reads plugin_idle_over_without (FULL_TIER_MINIMUMS)
GROUPS = ("idle", "repeat")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    batches = bench.size.batches if bench is not None else (1,)
    skip = bench is not None and "vllm" not in bench.backends
    marks = [pytest.mark.skip(reason="vllm is not in --benchmark-backends (the plugin runs inside vLLM)")] if skip \
        else []
    cases = [(g, n) for g in GROUPS for n in batches if g == "idle" or n in (bench.size.guard_batches if bench else ())]
    metafunc.parametrize("case", [pytest.param(c, marks=marks, id=f"{c[0]}-b{c[1]}") for c in cases])


def xargs(guard: dict[str, Any]) -> dict[str, Any]:
    return {f"repeat_terminate.{k}": v for k, v in guard.items() if k != "enabled"}


def test_vllm_plugin(bench, benchmark, case: tuple[str, int]) -> None:
    from vllm.inputs import TokensPrompt

    group, batch = case
    new_tokens = bench.size.new_tokens[0]
    messages = batch_messages(batch, "short")
    options = fixed_length(new_tokens)
    plain = bench.engine("vllm")
    rendered, plan = plain.prepare(messages, options=options)
    params = plain.backend.sampling_params(plan)  # the settings the engine sends, no rules in them
    prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in rendered]
    with_plugin = bench.raw_vllm(plugin=True)

    def run(llm: Any, sampling: Any) -> int:
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    if group == "idle":
        reference = Variant("raw", "reference", lambda: run(bench.raw_vllm(), params))
        subject = Variant("raw+plugin_idle", "subject", lambda: run(with_plugin, params))
        ratio = "plugin_idle_over_without"
    else:
        guarded = params.clone()
        guarded.extra_args = xargs(REPEAT_GUARD)
        reference = Variant("raw+plugin_idle", "reference", lambda: run(with_plugin, params))
        subject = Variant("raw+plugin_repeat", "subject", lambda: run(with_plugin, guarded))
        ratio = "guard_on_over_off"
    label = f"vllm_plugin[{group}-b{batch}]"
    rounds = bench.measure(benchmark, label, [reference, subject], gates={ratio: (subject.name, reference.name)})
    expected = batch * new_tokens
    for variant in (reference, subject):
        assert rounds.tokens(variant.name) == {expected}, (variant.name, rounds.tokens(variant.name), expected)
    figures = {ratio: rounds.speed_ratio(subject.name, reference.name)}
    if group == "repeat":
        figures["added_ms_per_step"] = (rounds.median_wall(subject.name) - rounds.median_wall(reference.name)) \
            / new_tokens * 1e3
    bench.record({"benchmark": label, "group": "vllm_plugin", "backend": "vllm", "batch": batch,
                  "prompt_len": "short", "prompt_tokens": sum(len(r.token_ids) for r in rendered),
                  "new_tokens": new_tokens, "fixed_length": True,
                  "guard_set": "none" if group == "idle" else "repeat"},
                 rounds, figures, benchmark)
