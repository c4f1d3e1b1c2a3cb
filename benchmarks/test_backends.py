"""llama.cpp vs HF vs vLLM on the same requests, the llama.cpp engine vs a raw ``Llama.generate``, and a llama.cpp
batch vs its rows one call each.

One case per batch size (1 and 8), variants interleaved in one run, each generating exactly ``batch x new_tokens``
greedy tokens (EOS held back through the engine; the raw loop takes that many tokens):

* ``hf``, ``vllm`` (references) and ``llamacpp`` (subject): the engine on each backend, same chat prompts, HF and
  vLLM on the SmolLM2 fixture, llama.cpp on its F32 GGUF twin (the same weights);
* ``llamacpp-raw`` (reference, batch 1): ``Llama.generate`` on the engine's own prompt ids with the same loaded
  model, no logits processor, its state reset first (``Llama.reset``) so it evaluates the whole prompt as the
  engine does;
* ``llamacpp-raw-cached`` (reference, batch 1, in no gate): the same call without the reset: llama-cpp-python then
  keeps the longest prefix its context already holds and, the prompt being the same every round, evaluates one
  token of it;
* ``llamacpp-b1`` (reference, batches above 1): the engine on llama.cpp given the same rows one call each (what a
  raw ``Llama.generate`` does with a batch: llama-cpp-python's generation API has none).

Recorded: ``llamacpp_over_hf`` and ``llamacpp_over_vllm`` (speed ratios, above 1: llama.cpp faster),
``engine_over_raw`` at batch 1 (what the engine's llama.cpp adapter costs on the same work; gated like every
``engine_over_raw``), ``engine_over_raw_cached`` at batch 1 (against the prefix-keeping call: what the adapter and
its history independence cost together; not gated: every group of the engine starts from an empty KV pool so a
row's tokens do not depend on the calls before it, ``engine/backends/llamacpp/sequences.py``, and so it evaluates a
repeated prompt again where a bare ``Llama`` would not) and ``batch_over_single`` above (what decoding a batch's
rows as parallel sequences of one llama.cpp batch gains over one row at a time; gated at 1.5, ``engine.report.gate``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import batch_messages, fixed_length

pytestmark = pytest.mark.gated  # the release gate reads its ratios: ENGINE_TIER=quick (CI) runs it

BATCHES = (1, 8)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backends_batch" in metafunc.fixturenames:
        on = metafunc.config.stash.get(SESSION_KEY, None) is not None
        metafunc.parametrize("backends_batch", BATCHES if on else BATCHES[:1])  # not opted in: one, skipped


def engine_variant(name: str, role: str, engine: Any, messages: list[Any], options: dict[str, Any]) -> Variant:
    def run() -> int:
        return sum(len(r.token_ids) for r in engine.generate(messages, options=options))

    return Variant(name, role, run)


def raw_llamacpp(engine: Any, messages: list[Any], options: dict[str, Any], *, keep_prefix: bool) -> Variant:
    rendered, _ = engine.prepare(messages, options=options)
    llm, n = engine.backend.llm, options["max_new_tokens"]

    def run() -> int:
        total = 0
        for r in rendered:
            if not keep_prefix:
                llm.reset()  # nothing kept: generate evaluates the whole prompt, as the engine's every call does
            generator = llm.generate(list(r.token_ids), temp=0.0, repeat_penalty=1.0)
            for count, _ in enumerate(generator, start=1):
                if count == n:
                    break
            generator.close()
            total += count
        return total

    return Variant("llamacpp-raw-cached" if keep_prefix else "llamacpp-raw", "reference", run)


def rows_one_by_one(engine: Any, messages: list[Any], options: dict[str, Any]) -> Variant:
    def run() -> int:
        return sum(len(engine.generate([m], options=options)[0].token_ids) for m in messages)

    return Variant("llamacpp-b1", "reference", run)


def test_backends(bench, benchmark, backends_batch: int) -> None:
    missing = [b for b in ("hf", "vllm") if b not in bench.backends]
    if missing:
        pytest.skip(f"the backends comparison needs {missing} in --benchmark-backends")
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install 'xbackend-engine[llamacpp]'; nox installs it)")
    messages = batch_messages(backends_batch, "short")
    options = fixed_length(bench.size.new_tokens[0])
    llamacpp = bench.engine("llamacpp")
    variants = [engine_variant("hf", "reference", bench.engine("hf"), messages, options),
                engine_variant("vllm", "reference", bench.engine("vllm"), messages, options),
                engine_variant("llamacpp", "subject", llamacpp, messages, options)]
    if backends_batch == 1:
        variants += [raw_llamacpp(llamacpp, messages, options, keep_prefix=False),
                     raw_llamacpp(llamacpp, messages, options, keep_prefix=True)]
        gates = {"engine_over_raw": ("llamacpp", "llamacpp-raw")}
        informational = {"engine_over_raw_cached": ("llamacpp", "llamacpp-raw-cached")}
    else:  # a raw Llama.generate runs rows one after another: the same as the engine's rows one call each
        variants.append(rows_one_by_one(llamacpp, messages, options))
        gates = {"batch_over_single": ("llamacpp", "llamacpp-b1")}
        informational = {}
    label = f"backends[llamacpp-b{backends_batch}-short-o{options['max_new_tokens']}]"
    rounds = bench.measure(benchmark, label, variants, gates=gates)
    expected = backends_batch * options["max_new_tokens"]
    for v in variants:  # fixed length: a variant that stopped early would flatter a ratio
        assert rounds.tokens(v.name) == {expected}, (v.name, rounds.tokens(v.name), expected)
    rendered, _ = llamacpp.prepare(messages, options=options)
    figures = {"llamacpp_over_hf": rounds.speed_ratio("llamacpp", "hf"),
               "llamacpp_over_vllm": rounds.speed_ratio("llamacpp", "vllm"),
               **{ratio: rounds.speed_ratio(*pair) for ratio, pair in {**gates, **informational}.items()}}
    bench.record({"benchmark": label, "group": "backends", "backend": "llamacpp", "batch": backends_batch,
                  "prompt_len": "short", "prompt_tokens": sum(len(r.token_ids) for r in rendered),
                  "new_tokens": options["max_new_tokens"], "fixed_length": True, "guard_set": "none"},
                 rounds, figures, benchmark)
