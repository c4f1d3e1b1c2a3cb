"""What schema-constrained decoding costs, per backend: ``python -m benchmarks.constrained_cost hf|vllm [rounds]``.

Eight chat prompts ("Describe the city of X as a JSON object.") through ``engine.complete`` on the SmolLM2
fixture (fp32), interleaved rounds of two variants in one process:

* ``constrained``: ``json_schema`` = ``fixtures/lm_eval_tasks/city_schema.json`` (xgrammar mask on HF, structured
  outputs on vLLM), up to 64 new tokens; rows end when the grammar is complete;
* ``free``: no schema, every row held to exactly the longest constrained row's length (``min_new_tokens`` =
  ``max_new_tokens``), so both variants run the same number of decode steps.

Printed: median ms per generated token and per decode step of each, and constrained / free for both. Rows of
the constrained batch end at different lengths, so its per-token figure also carries the steps where fewer rows
run; the per-step ratio is the mask's own cost. Not collected by pytest (a script, run by hand).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

CITIES = ["Paris", "Tokyo", "Madrid", "Berlin", "Rome", "Cairo", "Ottawa", "Lima"]
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_tasks" / "city_schema.json"


def measure(backend: str, rounds: int = 5) -> dict[str, float]:
    from engine import GenerationEngine
    from fixtures import fixture_path

    schema = json.loads(SCHEMA_FILE.read_text())
    engine = GenerationEngine({"backend": backend, "model": {"path": str(fixture_path("smollm2-135m-instruct")),
                                                             "dtype": "float32"}})
    try:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe the city of {c} as a JSON object."}],
                                           tokenize=False, add_generation_prompt=True) for c in CITIES]
        warm = engine.complete(prompts, options={"max_new_tokens": 64}, json_schema=schema)
        longest = max(len(r.token_ids) for r in warm)
        variants = {"constrained": ({"max_new_tokens": 64}, schema),
                    "free": ({"max_new_tokens": longest, "min_new_tokens": longest}, None)}
        per_token: dict[str, list[float]] = {v: [] for v in variants}
        per_step: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(rounds + 1):  # round 0 warms up; the order alternates
            for name in (list(variants) if i % 2 else list(reversed(variants))):
                options, constraint = variants[name]
                start = time.perf_counter()
                results = engine.complete(prompts, options=options, json_schema=constraint)
                wall = time.perf_counter() - start
                if i:
                    per_token[name].append(wall / sum(len(r.token_ids) for r in results))
                    per_step[name].append(wall / max(len(r.token_ids) for r in results))
    finally:
        engine.close()
    out = {f"{name}_ms_per_token": statistics.median(v) * 1e3 for name, v in per_token.items()}
    out.update({f"{name}_ms_per_step": statistics.median(v) * 1e3 for name, v in per_step.items()})
    out["per_token_ratio"] = out["constrained_ms_per_token"] / out["free_ms_per_token"]
    out["per_step_ratio"] = out["constrained_ms_per_step"] / out["free_ms_per_step"]
    return out


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "hf"
    figures = measure(backend, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    print(f"{backend}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
