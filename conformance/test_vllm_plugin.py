"""The guard as a vLLM plugin (``engine.vllm_plugin:EngineGuard``) inside the engines users build themselves: an
in-process ``vllm.LLM(logits_processors=[...])`` as verl and OpenRLHF build theirs, and stock ``vllm serve
--logits-processors ...`` with the seeds' start-up activation (what ``trl vllm-serve`` execs; TRL's own run:
``conformance/test_trl_vllm_serve.py``). The in-process HF engine with the same guard is the reference: looping rows
end at the same index with the same ids, healthy rows are untouched, min-length holds, bad settings are refused
before generation with the field, the value and the fix.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from conformance.subjects.plan import engines, processes, uses
from conformance.test_repeat import BUDGET, LOOP_GUARD, MIXED, REAL_LOOP_GUARD, mixes
from engine.vllm_plugin import PROCESSOR
from engine.vllm_plugin.replay import guard_report
from engine_fixtures import fixture_path, load_prompts

SUBJECTS = uses(
    engines("text"),
    engines("tiny-looper"),
    processes("stock vllm serve", why="the guard as a plugin inside stock vllm serve"),
)

pytestmark = [pytest.mark.slow, pytest.mark.runner_dependent]
ACTIVATION = {"COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION": "1",
              "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON": '{"enabled": true, "ngram_size": 5, "ngram_repeats": 4}'}
"""The served plugin's server-wide guard: the seeds' variables with ``REAL_LOOP_GUARD``."""
MIN_CHARS = 160


def xargs(guard: dict[str, Any]) -> dict[str, Any]:
    """A ``repeat_terminate`` subtree as the plugin's flat per-request keys (``vllm_xargs`` takes no nesting)."""
    return {f"repeat_terminate.{k}": v for k, v in guard.items() if k != "enabled"}


@pytest.fixture(scope="module")
def looper() -> str:
    return str(fixture_path("tiny-looper"))


@pytest.fixture(scope="session")
def plugin_llm(pool: Any, backend_names: tuple[str, ...]) -> Any:
    """A bare ``vllm.LLM`` on the looper with the plugin, built from the engine's own vLLM arguments (nothing of the
    engine's runs in it but the plugin's processor): what an RL framework builds in-process. Kept for the session, as
    the pool keeps its engines: an in-process vLLM engine that is deleted tears down the process's model-parallel
    groups, which every other in-process engine uses (the next one then fails: "pipeline model parallel group is not
    initialized")."""
    if "vllm" not in backend_names:
        pytest.skip(f"the plugin runs inside vLLM; backends here: {backend_names}")
    import vllm

    from engine.backends.vllm.backend import llm_kwargs

    engine = pool.reference("vllm", str(fixture_path("tiny-looper")))  # prepares vLLM's environment as the engine does
    return vllm.LLM(**llm_kwargs(engine.config.model, engine.config.vllm), logits_processors=[PROCESSOR])


def run_llm(llm: Any, prompts: list[tuple[int, ...]], extra_args: dict[str, Any] | None, max_tokens: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra_args)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_in_process_llm_ends_looping_rows_where_the_engine_does(pool, plugin_llm, looper):
    """verl / OpenRLHF's way: ``LLM(logits_processors=[...])`` and ``SamplingParams(extra_args=...)``. Every row has
    the ids of the HF engine's guarded row; the ones it ended answer ``stop`` with EOS last, and the replay of the rule
    on the returned ids (what a trainer reads) gives the engine's trigger index."""
    hf = pool.engine("hf", looper, repeat_terminate=LOOP_GUARD).generate(MIXED, options=BUDGET)
    fired = sum(r.meta["repeat_terminate_triggered"] for r in hf)
    assert mixes(fired, pool), f"the batch must mix looping ({fired}) and healthy rows"
    got = run_llm(plugin_llm, [r.prompt_token_ids for r in hf], xargs(LOOP_GUARD), BUDGET["max_new_tokens"])
    eos = pool.reference("hf", looper).tokenizer.eos_token_id
    for i, (want, out) in enumerate(zip(hf, got, strict=True)):
        assert tuple(out.token_ids) == tuple(want.token_ids), f"row {i}: HF {want.token_ids}, plugin {out.token_ids}"
        report = guard_report(out.token_ids, xargs(LOOP_GUARD), eos_id=eos)
        assert (report["repeat_terminate_triggered"], report["repeat_terminate_index"]) == \
            (want.meta["repeat_terminate_triggered"], want.meta["repeat_terminate_index"]), f"row {i}"
        if report["repeat_terminate_triggered"]:
            assert out.finish_reason == "stop" and out.token_ids[-1] == eos, f"row {i}"


def test_in_process_llm_without_settings_is_untouched(pool, plugin_llm, looper):
    """Loaded but not asked (no ``extra_args``, no start-up activation): every row is the unguarded engine's."""
    free = pool.reference("hf", looper).generate(MIXED, options=BUDGET)
    got = run_llm(plugin_llm, [r.prompt_token_ids for r in free], None, BUDGET["max_new_tokens"])
    assert [tuple(o.token_ids) for o in got] == [tuple(r.token_ids) for r in free]


@pytest.mark.parametrize(("extra", "field"), [
    ({"repeat_terminate.ngram_size": 1, "repeat_terminate.ngram_repeats": 3}, "repeat_terminate.ngram_size"),
    ({"repeat_terminate.max_consecutive_token_repeats": "four"}, "repeat_terminate.max_consecutive_token_repeats"),
    ({"repeat_terminate.bogus": 3}, "repeat_terminate.bogus"),
    ({"min_length.min_chars": -1}, "min_length.min_chars"),
    ({"repeat_terminate.max_consecutive_token_repeats": 2**63}, "repeat_terminate.max_consecutive_token_repeats"),
    ({"repeat_terminate.ngram_size": 10**12, "repeat_terminate.ngram_repeats": 2}, "repeat_terminate.ngram_size"),
], ids=["ngram_size 1", "a string", "an unknown field", "negative min_chars", "2^63 repeats", "ngram_size 10^12"])
def test_in_process_llm_refuses_bad_settings_before_generating(pool, plugin_llm, looper, extra, field):
    """vLLM runs the processor's ``validate_params`` at admission: the request is refused with the plugin's message
    (vLLM wraps it in its ``VLLMValidationError`` where it has one)."""
    try:
        from vllm.exceptions import VLLMValidationError as refused
    except ImportError:
        refused = ValueError
    with pytest.raises((ValueError, refused), match=rf"{field.replace('.', '[.]')}.*got .*Fix: "):
        run_llm(plugin_llm, [(1, 2, 3)], extra, 4)
    assert len(run_llm(plugin_llm, [(1, 2, 3)], None, 2)[0].token_ids) == 2  # the engine still runs


def test_in_process_llm_refuses_the_guard_with_ignore_eos(plugin_llm):
    """The row check runs at admission (``validate_params``), not only in the row decision's unit test: a request
    that asks for the guard and ignores EOS (the guard's way of ending a row) is refused before it runs."""
    from vllm import SamplingParams

    try:
        from vllm.exceptions import VLLMValidationError as refused
    except ImportError:
        refused = ValueError
    params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args=xargs(LOOP_GUARD))
    with pytest.raises((ValueError, refused), match=r"vllm_xargs[.]repeat_terminate .*ignore_eos.*Fix: "):
        plugin_llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)


# -- stock vllm serve with the plugin -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_plugin(pool: Any, backend_names: tuple[str, ...]) -> Any:
    """Stock ``vllm serve`` on ``--engine-model`` with ``--logits-processors engine.vllm_plugin:EngineGuard`` and the
    seeds' start-up variables (``ACTIVATION``), bound to 127.0.0.1, stopped after the module."""
    if "vllm" not in backend_names:
        pytest.skip(f"stock vllm serve runs vLLM; backends here: {backend_names}")
    from conformance.subjects.stock import start_vllm_serve

    _, config = pool.servers.served_config("vllm", pool.options.model)
    server = start_vllm_serve(config, "guarded", extra=["--logits-processors", PROCESSOR], env=ACTIVATION)
    yield server
    server.stop()


def complete(server: Any, prompt: tuple[int, ...], max_tokens: int, **fields: Any) -> tuple[int, dict[str, Any]]:
    """``POST /v1/completions`` with a token-id prompt, greedy, ``return_token_ids``: (status, the JSON answer)."""
    import httpx

    body = {"model": "guarded", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **fields}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    return answer.status_code, answer.json()


def chat_rows(pool: Any, prompts: list[Any], max_tokens: int, **sections: Any) -> list[Any]:
    return pool.engine("hf", pool.options.model, **sections).generate(prompts, options={"max_new_tokens": max_tokens})


def test_served_plugin_ends_the_real_loop_where_the_engine_does(pool, served_plugin):
    """The server-wide guard (the seeds' variables) on a request that asks nothing: SmolLM2's real loop on "30 fruits"
    ends at the HF engine's index with the same ids, ``finish_reason "stop"``; the same request with
    ``repeat_terminate.enabled: false`` runs on to its budget as the unguarded engine does."""
    by_id = {p["id"]: p["messages"] for p in load_prompts("json")}
    want = chat_rows(pool, [by_id["json-30-fruits"]], 160, repeat_terminate=REAL_LOOP_GUARD)[0]
    assert want.meta["repeat_terminate_triggered"] == 1
    status, got = complete(served_plugin, want.prompt_token_ids, 160)
    assert status == 200, got
    choice = got["choices"][0]
    assert tuple(choice["token_ids"]) == tuple(want.token_ids) and choice["finish_reason"] == "stop"
    eos = pool.reference("hf", pool.options.model).tokenizer.eos_token_id
    report = guard_report(choice["token_ids"], server=_activated(), eos_id=eos)
    assert report["repeat_terminate_index"] == want.meta["repeat_terminate_index"]
    free = chat_rows(pool, [by_id["json-30-fruits"]], 160)[0]
    status, off = complete(served_plugin, want.prompt_token_ids, 160, vllm_xargs={"repeat_terminate.enabled": False})
    assert status == 200 and tuple(off["choices"][0]["token_ids"]) == tuple(free.token_ids)


def _activated() -> Any:
    from engine.vllm_plugin.activation import guard_from_env

    return guard_from_env(ACTIVATION)


def test_served_plugin_leaves_healthy_rows_alone(pool, served_plugin, workload):
    """Chat answers and lists under the server-wide guard: the unguarded engine's ids, every one."""
    healthy = [p["messages"] for p in load_prompts("chat") + load_prompts("lists")]
    prompts = workload.pick(full=healthy, quick=healthy[4:])
    for i, free in enumerate(chat_rows(pool, prompts, 64)):
        status, got = complete(served_plugin, free.prompt_token_ids, 64)
        assert status == 200 and tuple(got["choices"][0]["token_ids"]) == tuple(free.token_ids), f"prompt {i}"


@pytest.mark.parametrize("bias", [0.0, 6.0], ids=["min_chars", "punctuation_bias"])
def test_served_plugin_holds_min_length(pool, served_plugin, bias):
    """``min_length.min_chars`` per request: EOS held back until the answer has that many characters, the same ids
    as the HF engine's ``min_length`` plugin (which the short free answer does not reach); with
    ``punctuation_bias`` too, sentence ends nudged past it (the plugin reads the server's tokenizer for them), the
    same ids as the HF engine's, which the bias changed."""
    question = [[{"role": "user", "content": "What is 2+2? Answer with one number."}]]
    free = chat_rows(pool, question, 96)[0]
    engine = pool.engine("hf", pool.options.model)

    def held(b: float) -> Any:
        return engine.generate(question, options={"max_new_tokens": 96}, plugins=[
            {"name": "min_length", "min_chars": MIN_CHARS, "punctuation_bias": b}])[0]

    want = held(bias)
    assert len(free.text) < MIN_CHARS <= len(want.text)
    if bias:
        assert want.token_ids != held(0.0).token_ids, "the bias must change the held answer for this check to see it"
    status, got = complete(served_plugin, want.prompt_token_ids, 96, vllm_xargs={
        "min_length.min_chars": MIN_CHARS, "min_length.punctuation_bias": bias, "repeat_terminate.enabled": False})
    assert status == 200 and tuple(got["choices"][0]["token_ids"]) == tuple(want.token_ids)


KILLERS = {
    "2^63 repeats": ({"repeat_terminate.max_consecutive_token_repeats": 2**63}, {},
                     "repeat_terminate.max_consecutive_token_repeats"),
    "2^63 min_new_tokens": ({"repeat_terminate.min_new_tokens": 2**63}, {}, "repeat_terminate.min_new_tokens"),
    "ngram_size 10^12": ({"repeat_terminate.ngram_size": 10**12, "repeat_terminate.ngram_repeats": 2}, {},
                         "repeat_terminate.ngram_size"),
    "2^62 ngram_repeats": ({"repeat_terminate.ngram_size": 4, "repeat_terminate.ngram_repeats": 2**62}, {},
                           "repeat_terminate.ngram_repeats"),
    "2^63 min_chars": ({"min_length.min_chars": 2**63}, {}, "min_length.min_chars"),
    "bias 1e300": ({"min_length.min_chars": 10, "min_length.punctuation_bias": 1e300}, {},
                   "min_length.punctuation_bias"),
    "guard with ignore_eos": ({"repeat_terminate.max_consecutive_token_repeats": 4}, {"ignore_eos": True},
                              "ignore_eos"),
}
"""Round 4 of the hostile clients: per-request settings that passed ``validate_params`` and then raised inside the
engine core's step (int64 counters, a ring of ``ngram_size`` columns), taking stock ``vllm serve`` down; and the row
check (the guard ends rows with EOS) that only a unit test applied."""


@pytest.mark.parametrize(("xargs_", "fields", "field"), [
    ({"repeat_terminate.ngram_size": 1}, {}, "repeat_terminate.ngram_size"),
    ({"min_length.max_chars": 0}, {}, "min_length.max_chars"),
    ({"repeat_terminate.enabled": "maybe"}, {}, "repeat_terminate.enabled"),
    *KILLERS.values(),
], ids=["ngram_size 1", "max_chars 0", "enabled maybe", *KILLERS])
def test_served_plugin_refuses_bad_xargs_with_a_400(served_plugin, xargs_, fields, field):
    """Refused at admission with the field, the value and the fix; then an ordinary request is answered, so the
    engine core is still alive."""
    status, body = complete(served_plugin, (1, 2, 3), 4, vllm_xargs=xargs_, **fields)
    assert status == 400, body
    message = body["error"]["message"]
    assert field in message and "Fix:" in message, message
    status, after = complete(served_plugin, (1, 2, 3), 2)
    assert status == 200 and len(after["choices"][0]["token_ids"]) == 2, after


@pytest.mark.gate_only(reason=(
    "a second stock vllm serve started to watch it refuse (32 s on CI); CI keeps the same subtree "
    "refused by name through stock vllm serve per request "
    "(test_served_plugin_refuses_bad_xargs_with_a_400) and from the server's environment "
    "(tests/test_vllm_plugin_rules.py::test_a_bad_server_guard_names_its_variable)"))
def test_a_bad_startup_activation_stops_vllm_serve(pool, backend_names):
    """A bad server-wide subtree fails the start (the engine core builds the processor), not the first request."""
    if "vllm" not in backend_names:
        pytest.skip(f"stock vllm serve runs vLLM; backends here: {backend_names}")
    from conformance.subjects.stock import start_vllm_serve

    _, config = pool.servers.served_config("vllm", str(fixture_path("tiny-looper")))
    bad = {"ENGINE_REPEAT_TERMINATE_JSON": '{"enabled": true, "ngram_size": 4}'}
    with pytest.raises(RuntimeError, match=r"exited with") as failed:
        server = start_vllm_serve(config, "bad", extra=["--logits-processors", PROCESSOR], env=bad, timeout=300)
        server.stop()
    assert "repeat_terminate.ngram_repeats (from env:ENGINE_REPEAT_TERMINATE_JSON) must be set together" in \
        failed.value.log


def test_the_plugin_is_import_light():
    """``import engine.vllm_plugin`` (what names the processor) imports neither vLLM nor torch."""
    import subprocess
    import sys

    code = "import sys, engine.vllm_plugin; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"
