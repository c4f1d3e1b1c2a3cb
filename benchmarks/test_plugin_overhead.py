"""Each built-in plugin's cost per backend: generation time with vs without it, interleaved in one run.

Plugins change how much is generated (JSON boundary shortens rows, min-length lengthens them), so both the
wall-time ratio and the per-generated-token time ratio are reported.
"""

from __future__ import annotations

import statistics
import time

import pytest

from fixtures import load_prompts

PLUGINS = {
    "json_boundary": [{"name": "json_boundary"}],
    "cleanup": [{"name": "cleanup", "sentence_end": True, "close_brackets": True}],
    "min_length": [{"name": "min_length", "min_chars": 300, "punctuation_bias": 2.0}],
}
ROUNDS = 3


@pytest.fixture(scope="session")
def smollm2_engines():
    from engine import GenerationEngine
    from fixtures import ensure

    path = str(ensure("smollm2-135m-instruct"))
    return {b: GenerationEngine({"backend": b, "model": {"path": path, "dtype": "float32"}}) for b in ("hf", "vllm")}


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_plugin_overhead(benchmark, smollm2_engines, backend, plugin):
    eng = smollm2_engines[backend]
    prompts = [p["messages"] for p in load_prompts("chat") + load_prompts("json")[:3]]
    opts = {"max_new_tokens": 64}
    runs = {"off": [], "on": []}
    tokens = {"off": 0, "on": 0}
    for plugins in ([], PLUGINS[plugin]):
        eng.generate(prompts, options=opts, plugins=plugins)  # warm-up (and the vocabulary scan, once)
    for _ in range(ROUNDS):  # interleaved: noise hits both sides alike
        for name, plugins in (("off", []), ("on", PLUGINS[plugin])):
            t = time.perf_counter()
            out = eng.generate(prompts, options=opts, plugins=plugins)
            runs[name].append(time.perf_counter() - t)
            tokens[name] = sum(len(r.token_ids) for r in out)
    benchmark.pedantic(lambda: eng.generate(prompts, options=opts, plugins=PLUGINS[plugin]), rounds=1)
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    per_token = (on / tokens["on"]) / (off / tokens["off"])
    benchmark.extra_info.update({"backend": backend, "plugin": plugin, "median_off_s": off, "median_on_s": on,
                                 "tokens_off": tokens["off"], "tokens_on": tokens["on"],
                                 "time_ratio_on_off": on / off, "per_token_time_ratio_on_off": per_token})
    print(f"{backend} {plugin}: time on/off {on / off:.3f} ({on:.2f}s / {off:.2f}s), tokens {tokens['on']}/"
          f"{tokens['off']}, per-token time on/off {per_token:.3f}")
    assert tokens["on"] > 0 and tokens["off"] > 0
