"""vLLM with its engine core in a child process (``vllm.multiprocessing: true``, vLLM's own default outside
tests): the rules run in that process, and their events (trigger index, the rule that ended a row)
come back over ``collective_rpc`` with the same tokens and meta as with the engine core in-process.

The served engine (``AsyncLLM``, ``conformance/test_served.py`` and the served twins) always runs its engine
core in a child process; this check covers the offline ``vllm.LLM`` path. ``--engine-vllm-multiprocessing``
reruns any selection of the suite that way.
"""

from __future__ import annotations

import pytest

from conformance.compare import assert_same_results
from conformance.subjects.plan import engines, servers, uses
from conformance.test_repeat import BUDGET, LOOP_GUARD, MIXED

SUBJECTS = uses(engines("tiny-looper"), engines("tiny-looper", vllm={}), servers("tiny-looper"))

pytestmark = [pytest.mark.slow, pytest.mark.runner_dependent]


@pytest.fixture(scope="module")
def engine_cores(pool, backend_names):
    """The guarded looper engine with its engine core in-process and in a child process (and HF's)."""
    if "vllm" not in backend_names:
        pytest.skip("vLLM is not among the backends of this run (--engine-backends)")
    from engine_fixtures import fixture_path

    looper = str(fixture_path("tiny-looper"))
    engines = {}
    for child in (False, True):
        settings = {**pool.config("vllm", looper)["vllm"], "multiprocessing": child}
        name = "vllm child process" if child else "vllm in-process"
        if settings["multiprocessing"] == pool.options.vllm_multiprocessing:
            engines[name] = pool.engine("vllm", looper, repeat_terminate=LOOP_GUARD)  # the one test_repeat uses
        else:
            engines[name] = pool.engine("vllm", looper, repeat_terminate=LOOP_GUARD, vllm=settings)
    if "hf" in backend_names:
        engines["hf"] = pool.engine("hf", looper, repeat_terminate=LOOP_GUARD)
    return engines


@pytest.mark.servable
def test_repeat_trigger_meta_comes_back_from_the_engine_core_process(engine_cores, pool):
    got = {name: e.generate(MIXED, options=BUDGET) for name, e in engine_cores.items()}
    child = got["vllm child process"]
    fired = [r.meta["repeat_terminate_index"] for r in child if r.meta["repeat_terminate_triggered"]]
    assert 0 < len(fired) < len(MIXED), f"the batch must mix looping and healthy rows, fired at {fired}"
    assert_same_results(got, what="repeat guard, engine core in-process vs child process", dtype=pool.options.dtype)


def test_min_length_cap_events_come_back_from_the_engine_core_process(engine_cores, pool):
    """The looper never ends by itself, so its rows meet min_length's cap (a rule that forces EOS) unless the
    repeat guard ends them first: both kinds of rule events, one call."""
    plugins = [{"name": "min_length", "min_chars": 10, "max_chars": 120}]
    got = {name: e.generate(MIXED, options=BUDGET, plugins=plugins) for name, e in engine_cores.items()}
    ended = [r.stop_reason for r in got["vllm child process"]]
    assert "min_length" in ended, f"no row met the cap in the child process (stop reasons: {ended})"
    assert_same_results(got, what="min_length cap, engine core in-process vs child process", dtype=pool.options.dtype)
