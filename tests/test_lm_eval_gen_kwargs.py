"""How a task's ``gen_kwargs`` become engine options (``EngineLM._options``): sampling keys kept only when the task
samples, as HF's ``generate`` ignores them when greedy, and any key the engine does not map refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval", reason="the lm-eval extra (installed by `nox -s tests`)")

from engine.errors import ConfigError
from engine.lm_eval.model import EngineLM

MODEL = SimpleNamespace(max_gen_toks=32)


def options(gen_kwargs):
    return EngineLM._options(MODEL, gen_kwargs, eos="</s>")


def test_sampling_keys_reach_the_engine_when_the_task_samples():
    got, until = options({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                          "seed": 3, "until": ["\n"]})
    assert got == {"max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3}
    assert "\n" in until


def test_greedy_tasks_drop_the_sampling_keys_and_unknown_keys_are_refused():
    got, _ = options({"do_sample": False, "temperature": 0.0, "top_p": 0.9, "min_p": 0.1, "max_gen_toks": 8})
    assert got == {"max_new_tokens": 8, "temperature": 0.0}
    with pytest.raises(ConfigError, match="typical_p"):
        options({"typical_p": 0.5})
