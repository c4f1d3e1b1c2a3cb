"""What schema-constrained decoding costs on each backend (the lm-eval model's ``constrained=true``).

Eight chat prompts ("Describe the city of X as a JSON object.", the ``engine_json`` task's) through
``engine.complete``, two variants interleaved in one run:

* ``free`` (reference): no schema, every row held to exactly the constrained batch's longest row
  (``min_new_tokens == max_new_tokens``), so both variants run the same number of decode steps;
* ``constrained`` (subject): ``json_schema`` = ``fixtures/lm_eval_tasks/city_schema.json`` (xgrammar's mask on HF,
  vLLM's structured outputs), up to 64 tokens; each row ends when its grammar is complete (greedy: the same
  lengths every round, asserted).

Recorded: ``constrained_over_free`` (free median wall / constrained median wall at equal decode steps: the
mask's cost, above 1 meaning constrained is faster), ``added_ms_per_step`` and each variant's ``us_per_token``
(the constrained batch generates fewer tokens per step once its rows end, so its per-token figure is the higher).
Every constrained answer must validate against the schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant

CITIES = ("Paris", "Tokyo", "Madrid", "Berlin", "Rome", "Cairo", "Ottawa", "Lima")
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_tasks" / "city_schema.json"
BUDGET = 64


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "constrained_backend" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    backends = list(bench.backends) if bench is not None else ["hf"]  # not opted in: one placeholder, skipped
    metafunc.parametrize("constrained_backend", backends)


def completer(name: str, role: str, engine: Any, prompts: list[str], options: dict[str, Any],
              schema: dict[str, Any] | None, seen: dict[str, Any]) -> Variant:
    def run() -> int:
        results = engine.complete(prompts, options=options, json_schema=schema)
        seen[name] = [r.token_ids for r in results]
        return sum(len(r.token_ids) for r in results)

    return Variant(name, role, run)


def test_constrained_cost(bench, benchmark, constrained_backend: str) -> None:
    engine = bench.engine(constrained_backend)
    schema = json.loads(SCHEMA_FILE.read_text())
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe the city of {c} as a "
                                                                                  "JSON object."}],
                                                    tokenize=False, add_generation_prompt=True) for c in CITIES]
    first = engine.complete(prompts, options={"max_new_tokens": BUDGET}, json_schema=schema)
    for result in first:  # the schema: exactly the string fields city and country
        answer = json.loads(result.text)
        assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values()), answer
    steps = max(len(r.token_ids) for r in first)
    assert steps < BUDGET, "a constrained answer ran out of budget; the steps would not be the grammar's"
    seen: dict[str, Any] = {}
    free = completer("free", "reference", engine, prompts, {"max_new_tokens": steps, "min_new_tokens": steps},
                     None, seen)
    constrained = completer("constrained", "subject", engine, prompts, {"max_new_tokens": BUDGET}, schema, seen)
    label = f"constrained[{constrained_backend}-b{len(prompts)}]"
    rounds = bench.measure(benchmark, label, [free, constrained], gated=False)
    assert rounds.tokens("free") == {steps * len(prompts)}
    assert seen["constrained"] == [r.token_ids for r in first], "greedy constrained rows must repeat exactly"
    added = rounds.median_wall("constrained") - rounds.median_wall("free")
    figures = {"constrained_over_free": rounds.speed_ratio("constrained", "free"),
               "added_ms_per_step": added / steps * 1e3}
    bench.record({"benchmark": label, "group": "constrained", "backend": constrained_backend, "batch": len(prompts),
                  "prompt_len": "cities", "prompt_tokens": sum(len(engine.tokenizer.encode(p)) for p in prompts),
                  "new_tokens": steps, "fixed_length": False, "guard_set": "json_schema"},
                 rounds, figures, benchmark)
    per_token = {name: rounds.median_wall(name) / max(min(rounds.tokens(name)), 1) * 1e6
                 for name in ("free", "constrained")}
    bench.progress(f"{label} us/token: " + ", ".join(f"{k} {v:.0f}" for k, v in per_token.items()))
