"""LoRA adapters (``model.adapters``, a request's ``adapter``) on every backend: the same trained adapter gives the
same greedy tokens on HF + PEFT, vLLM and llama.cpp (its GGUF twin); adapter rows part from base rows on each backend
(the checks' teeth: a backend that dropped the adapter would answer the base model's rows); a batch that mixes the
base model and two adapters equals each row run alone (vLLM's CPU kernels fail this unaided: engine.backends.vllm.lora);
stops, the repeat guard and min-length hold with an adapter active; logprobs agree; an unknown adapter name, and an
adapter of another base model, are refused by name before anything is generated.

The parity, mixed-batch, rules, logprobs and rollout checks are ``servable``: their served twins send the same calls
through each backend's server (``/infer/`` with swift's ``adapter_request``; a mixed call as one ``/infer/`` per
adapter at once) and hold every answer equal to the in-process one. The served checks below drive the OpenAI
``model`` field, vLLM's LoRA routes, the adapter-only weight sync, stock ``vllm serve`` and TRL's client.

The adapters are the ``smollm2-lora`` fixture's (seeded, not trained: rank 8 on the query and value projections,
rank 16 on every projection; ``fixtures/lora.py``), on the text fixture they were made for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.compare import (
    assert_same_results,
    check_logprobs_close,
    check_rollout_band,
    describe,
    divergence_steps,
    exact_pair,
)
from conformance.subjects.plan import engines, processes, servers, uses
from conformance.subjects.served import SERVED
from engine.errors import ConfigError, RequestError
from engine.types import ChatRequest
from engine_fixtures import ensure, load_prompts

SUBJECTS = uses(
    engines("text", any_config="the LoRA fixture's adapters as model.adapters (folders known at run time)"),
    engines("tiny", any_config="the SmolLM2 adapters on the tiny fixture: refused at load, before the backend starts"),
    servers("text", any_config="the adapters at start, and serve.adapter_loading for vLLM's LoRA routes"),
    processes("stock vllm serve", why="stock vllm serve --enable-lora --lora-modules with the guard's plugin, beside "
                                      "ours"),
)

# float32, as issue 78 asks: not marked dtype_dependent, so the bfloat16 pass (nox -s conformance-bf16) leaves it out

NAMES = ("r8", "r16")
OPTIONS = {"max_new_tokens": 24, "logprobs": 5}


def adapter_folders() -> dict[str, str]:
    root = Path(ensure("smollm2-lora"))
    return {name: str(root / name) for name in NAMES}


VLLM_LORA = {"multiprocessing": True}
"""Where vLLM's LoRA engine runs in the full gate: its engine core in a child process. In the test process it held
1.9 GiB (weights, KV cache, LoRA buffers), which the gate kept to its end beside every other engine (its peak was
11.6 GiB at 10bba47, above the CI's 12 GB per process); in a child the test process keeps 0.4 GiB of it. The quick
tier, whose process peaks lower, keeps it in process: the child's start took 51 s here, the in-process one 19 s."""


@pytest.fixture(scope="module")
def lora(pool, workload):
    """The sections of this module's engines: both adapters at load; their servers (the served twins', and the
    served checks') with vLLM's LoRA routes on too (``serve`` is per request in process: no second engine); vLLM's
    engine core placed by :data:`VLLM_LORA` (its servers are the same either way: a served vLLM engine always runs
    its core in a child process)."""
    placed = workload.pick(full={"vllm": {**pool.config("vllm", pool.options.model)["vllm"], **VLLM_LORA}}, quick={})

    def sections(**more):
        return {"model": {"adapters": adapter_folders()}, "serve": {"adapter_loading": True}, **placed, **more}

    return sections


@pytest.fixture(scope="module")
def lora_engines(pool, backend_names, text_model, lora):
    """Every runnable backend's engine on the text fixture with both adapters loaded."""
    return {b: pool.engine(b, text_model, **lora()) for b in backend_names}


def answers_of(rows, lora_engines, reach, adapter):
    """Each backend's rows with ``adapter`` (None: the base model): in process the module's rows; for a served
    twin the same calls through each backend's server, which the twin holds equal to the in-process rows."""
    if reach != SERVED:
        return {b: by_adapter[adapter] for b, by_adapter in rows.items()}
    return {b: e.generate(messages(), options=OPTIONS, adapter=adapter) for b, e in lora_engines.items()}


def messages():
    return [p["messages"] for p in load_prompts("chat")[:6]]


def parity(outs, pool, prompts, summary_note, what):
    """Every backend against the first: exact where the pair must be (HF and vLLM in fp32), else vLLM's rule."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pool.options.model)
    reference, *others = list(outs)
    for other in others:
        steps = divergence_steps(outs[reference], outs[other])
        summary_note(f"{what} {reference} vs {other}: {steps.count(None)}/{len(steps)} token-identical")
        if exact_pair(reference, other, pool.options.dtype):
            detail = describe(outs[reference], outs[other], name_0=reference, name_1=other,
                              labels=[str(i) for i in range(len(prompts))], tokenizer=tokenizer)
            assert steps.count(None) == len(steps), "\n".join(detail)
        else:
            check_logprobs_close(outputs_0=outs[reference], outputs_1=outs[other], name_0=reference, name_1=other)


@pytest.fixture(scope="module")
def rows(lora_engines):
    """Each backend's greedy rows of the chat prompts on the base model and with each adapter (one call each): what
    the parity, teeth and mixed-batch checks compare."""
    prompts = messages()
    return {b: {name: e.generate(prompts, options=OPTIONS, adapter=name) for name in (None, *NAMES)}
            for b, e in lora_engines.items()}


@pytest.mark.servable  # the quick tier runs its first variant, r8 in process; the mixed batch check carries r16
@pytest.mark.parametrize("adapter", NAMES)
def test_greedy_parity_with_each_adapter(rows, lora_engines, reach, pool, summary_note, adapter):
    outs = answers_of(rows, lora_engines, reach, adapter)
    for b, results in outs.items():
        assert all(r.meta.get("adapter") == adapter for r in results), f"{b}: rows do not say they ran with {adapter}"
    parity(outs, pool, messages(), summary_note, f"greedy parity with adapter {adapter}")


@pytest.mark.quick
def test_adapter_rows_part_from_base_rows_on_every_backend(rows, summary_note):
    """The teeth: on each backend, each adapter's greedy rows differ from the base model's (and from each other's)
    on most prompts; a backend that dropped an adapter, or applied one to base rows, would answer alike."""
    n = len(messages())
    for backend, by_adapter in rows.items():
        ids = {name: [r.token_ids for r in results] for name, results in by_adapter.items()}
        apart = {name: sum(a != b for a, b in zip(ids[None], ids[name], strict=True)) for name in NAMES}
        between = sum(a != b for a, b in zip(ids["r8"], ids["r16"], strict=True))
        summary_note(f"{backend}: rows apart from the base model's: r8 {apart['r8']}/{n}, r16 {apart['r16']}/{n}; "
                     f"r8 apart from r16: {between}/{n}")
        assert min(apart.values()) >= n // 2 and between >= n // 2, (backend, apart, between)
        assert all("adapter" not in r.meta for r in by_adapter[None]), f"{backend}: a base row names an adapter"


@pytest.mark.servable  # the quick tier runs it in process (its first variant); its served twin in the full gate
def test_a_mixed_batch_equals_each_row_run_alone(lora_engines, rows, pool):
    """Base rows beside rows of two adapters, in one call: each row equals the same request run with its adapter
    alone (vLLM batches them in one step; HF and llama.cpp run one adapter per forward), and every backend agrees.
    vLLM's CPU kernels alone would give the base rows the last loaded adapter's tokens here."""
    prompts = messages()
    picks = [(None, "r8", "r16")[i % 3] for i in range(len(prompts))]
    mixed = [ChatRequest(tuple(m), adapter=pick) for m, pick in zip(prompts, picks, strict=True)]
    outs = {}
    for backend, engine in lora_engines.items():
        together = engine.generate(mixed, options=OPTIONS)
        alone = [rows[backend][pick][i] for i, pick in enumerate(picks)]
        assert_same_results({f"{backend} mixed": together, f"{backend} alone": alone}, what="a mixed batch",
                            dtype=pool.options.dtype)
        assert [r.meta.get("adapter") for r in together] == picks
        outs[backend] = together
    reference, *others = list(outs)
    for other in others:
        if exact_pair(reference, other, pool.options.dtype):
            assert divergence_steps(outs[reference], outs[other]).count(None) == len(prompts), (reference, other)


@pytest.mark.gate_only(reason="hf.merge_adapters is one backend's option; test_greedy_parity_with_each_adapter "
                              "carries the unmerged path every backend shares")
def test_hf_merged_adapters_answer_the_unmerged_rows_and_restore_the_base_exactly(rows, pool, text_model, lora,
                                                                                  summary_note):
    """``hf.merge_adapters``: each adapter's rows equal the unmerged ones (token for token where float rounding does
    not part them, else by vLLM's rule at the divergence), and the base rows after merged calls are the unmerged
    engine's base rows exactly (every merged weight restored from its original, not subtracted back)."""
    if "hf" not in rows:
        pytest.skip("hf is not among this session's backends")
    sections = lora(hf={"merge_adapters": True})
    merged = pool.engine("hf", text_model, **sections)
    try:
        for name in NAMES:
            got = merged.generate(messages(), options=OPTIONS, adapter=name)
            steps = divergence_steps(rows["hf"][name], got)
            summary_note(f"hf merged vs unmerged, adapter {name}: {steps.count(None)}/{len(steps)} token-identical")
            check_logprobs_close(outputs_0=rows["hf"][name], outputs_1=got, name_0="unmerged", name_1="merged")
        base = merged.generate(messages(), options=OPTIONS)
    finally:  # its only user: closed now, not at the session's end (the test process rose 0.95 GiB with it)
        del merged
        pool.drop("hf", text_model, **sections)
    assert [r.token_ids for r in base] == [r.token_ids for r in rows["hf"][None]]
    assert [r.logprobs for r in base] == [r.logprobs for r in rows["hf"][None]], "a merged weight was not restored"


@pytest.mark.servable
@pytest.mark.gate_only(reason="test_greedy_parity_with_each_adapter carries the adapter path on every backend; the "
                              "rules' own checks (test_stop, test_repeat, test_rule_ends) carry stops and guards")
def test_stops_min_length_and_the_repeat_guard_hold_with_an_adapter(lora_engines, pool, text_model, lora,
                                                                    summary_note):
    """The engine's rules run beside the adapter: a stop string ends rows, min-length holds EOS back, the repeat
    guard ends a looping row; every backend alike."""
    prompts = messages()
    guard = {"enabled": True, "max_consecutive_token_repeats": 2, "ngram_size": 2, "ngram_repeats": 2}
    guarded = {b: pool.engine(b, text_model, **lora(repeat_terminate=guard)) for b in lora_engines}
    calls = {"stop": (lora_engines, {"options": OPTIONS, "stop": {"strings": ["."]}}),
             "min_length": (lora_engines, {"options": {**OPTIONS, "min_new_tokens": 12}}),
             "guard": (guarded, {"options": {**OPTIONS, "max_new_tokens": 48}})}  # one chat row repeats by 48
    for what, (subjects, call) in calls.items():
        outs = {b: e.generate(prompts, adapter="r16", **call) for b, e in subjects.items()}
        for backend, rows in outs.items():
            if what == "stop":
                assert any(r.stop_reason == "." for r in rows), f"{backend}: no row ended at the stop string"
            elif what == "min_length":
                assert all(len(r.token_ids) >= 12 for r in rows), f"{backend}: a row ended before min_new_tokens"
            else:
                assert any(r.stop_reason == "repeat_terminate" for r in rows), f"{backend}: the guard never ended a row"
        parity(outs, pool, prompts, summary_note, f"{what} with adapter r16")


@pytest.mark.servable
def test_logprobs_with_an_adapter_agree_in_fp32(lora_engines, pool):
    """The chosen tokens' raw log-probabilities under an adapter agree within 1e-3 in fp32 where the tokens agree
    (the bound of test_parity.test_logprobs_agree_in_fp32)."""
    if pool.options.dtype != "float32":
        pytest.skip("the 1e-3 bound is float32's; lower precision is held to vLLM's rule by the parity checks")
    msgs = messages()[:2]
    outs = {b: e.generate(msgs, options={"max_new_tokens": 12, "logprobs": 3}, adapter="r8")
            for b, e in lora_engines.items()}
    reference, *others = list(outs)
    for other in others:
        for row, (a, b) in enumerate(zip(outs[reference], outs[other], strict=True)):
            shared = divergence_steps([a], [b])[0]
            for step, (la, lb) in enumerate(list(zip(a.logprobs, b.logprobs, strict=False))[:shared]):
                chosen = a.token_ids[step]
                assert abs(la[chosen] - lb[chosen]) < 1e-3, (other, row, step, la[chosen], lb[chosen])


@pytest.fixture(scope="module")
def peft_trainer(pool):
    """The trainer's view, built with PEFT itself and nothing of the engine: the text fixture in float32 with both
    adapters, as a LoRA trainer holds it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pool.options.model, dtype=torch.float32).eval()
    folders = adapter_folders()
    model = PeftModel.from_pretrained(base, folders["r8"], adapter_name="r8", is_trainable=False)
    model.load_adapter(folders["r16"], adapter_name="r16", is_trainable=False)
    return model.eval()


def peft_logprobs(model, adapter, rollout):
    """Each rollout row's tokens, teacher-forced through the PEFT model with ``adapter`` active."""
    import torch

    model.set_adapter(adapter)
    out = []
    with torch.no_grad():
        for row in rollout:
            ids = torch.tensor([list(row.prompt_token_ids) + list(row.token_ids)])
            logits = model(input_ids=ids).logits[0, len(row.prompt_token_ids) - 1 : -1].float()
            chosen = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(list(row.token_ids))[:, None])[:, 0]
            out.append(chosen.tolist())
    return out


@pytest.mark.servable  # the quick tier runs it in process (its first variant); its served twin in the full gate
def test_rollout_logprobs_with_an_adapter_equal_the_peft_trainers_rescoring(lora_engines, peft_trainer, pool,
                                                                            summary_note):
    """Rollout vs trainer with LoRA: each backend's sampled rollout with adapter r16 (temperature, top-p, a repetition
    penalty: the reported logprobs are the model's raw ones) re-scored teacher-forced by PEFT's own model with r16;
    in float32 every token within 2e-3 and every sequence's importance ratio within 1 %, the band of
    test_divergences.py::test_rollout_logprobs_equal_the_trainers_rescoring. A rollout that dropped its adapter is
    far outside it."""
    from engine.trainer.mismatch import chosen_logprobs, logprob_mismatch

    options = {"max_new_tokens": 24, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3, "seed": 5,
               "logprobs": 0}
    for backend, engine in lora_engines.items():
        rollout = engine.generate(messages()[:4], options=options, adapter="r16")
        got = logprob_mismatch([chosen_logprobs(r) for r in rollout], peft_logprobs(peft_trainer, "r16", rollout))
        check_rollout_band(got, what=f"rollout {backend} with adapter r16 vs PEFT trainer", dtype=pool.options.dtype,
                           note=summary_note)


@pytest.mark.quick
def test_score_is_the_base_models_whatever_adapter_ran_last(lora_engines, rows, pool, text_model, summary_note):
    """``engine.score`` takes no adapter: it scores with the base model, also on an engine whose last rows ran with
    an adapter. Each scoring backend's LoRA engine, right after rows with r16, scores the base model's greedy rows as
    its plain engine does (float32: within 1e-4; PEFT on HF once scored with the last adapter set). vLLM with LoRA on
    a CPU host cannot score (its CPU LoRA logits kernels fail on prompt log-probabilities, vllm#29955): refused by
    name before anything runs, where it took the engine down."""
    from engine.errors import UnsupportedCapabilityError

    for backend, twin in lora_engines.items():
        local = twin.local
        caps = local.backend.capabilities
        if caps.scoring_problem is not None:
            with pytest.raises(UnsupportedCapabilityError, match="vllm#29955"):
                local.score([[1, 2, 3]], [1])
            local.generate(messages()[:1], options={"max_new_tokens": 4})  # still generating
            summary_note(f"{backend}: score refused with LoRA on: {caps.scoring_problem[:60]}...")
            continue
        if not caps.scoring:
            continue
        local.generate(messages()[:1], options={"max_new_tokens": 4}, adapter="r16")  # the adapter ran last
        base_rows = rows[backend][None][:3]
        sequences = [list(r.prompt_token_ids) + list(r.token_ids) for r in base_rows]
        starts = [len(r.prompt_token_ids) for r in base_rows]
        got = local.score(sequences, starts)
        want = pool.loaded(backend, text_model).score(sequences, starts)
        worst = max(abs(a - b) for g, w in zip(got, want, strict=True)
                    for a, b in zip(g.logprobs, w.logprobs, strict=True))
        summary_note(f"{backend}: score on the LoRA engine vs the plain engine: worst |dlogprob| {worst:.2e}")
        bound = 1e-4 if pool.options.dtype == "float32" else 5e-2
        assert worst < bound, f"{backend}: the LoRA engine scored with an adapter ({worst:.3g} off the base model)"


def test_an_unknown_adapter_is_refused_by_name_before_generation(lora_engines, count_backend_calls):
    for backend, engine in lora_engines.items():
        calls = count_backend_calls(engine.local)
        with pytest.raises(RequestError) as info:
            engine.local.generate(messages()[:1], adapter="r32")
        assert info.value.field == "adapter" and "loaded: r16, r8" in str(info.value), (backend, str(info.value))
        request = ChatRequest(tuple(messages()[0]), adapter="nope")
        with pytest.raises(RequestError) as info:
            engine.local.generate([messages()[0], request])
        assert info.value.field == "requests[1].adapter", backend
        assert calls == [], f"{backend} generated before refusing"


def test_an_adapter_of_another_base_model_is_refused_at_load(pool, backend_names):
    """SmolLM2's adapters on the tiny fixture (another hidden size): refused naming the adapter, on every backend
    (HF and vLLM by the engine's shape check before the backend starts; llama.cpp by its own check on the GGUF)."""
    from engine import GenerationEngine

    for backend in backend_names:
        config = pool.config(backend, pool.options.tiny_model, model={"adapters": adapter_folders()})
        with pytest.raises(ConfigError) as info:
            GenerationEngine(config)
        assert info.value.field.startswith("model.adapters.r"), (backend, str(info.value))


# -- served: the OpenAI model field, /v1/models, vLLM's LoRA routes, swift's adapter_request ------------------------


@pytest.fixture
def lora_server(pool, backend, text_model, lora):
    """The pool's server of ``backend`` with both adapters loaded at start and vLLM's LoRA routes on."""
    from conformance.kit.availability import unavailable_reason

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    return pool.servers.server(*pool.servers.served_config(backend, text_model, **lora()))


def chat_ids(client, model, prompts, max_tokens=24):
    """Each prompt's greedy token ids through ``/v1/chat/completions`` (vLLM's ``return_token_ids``)."""
    out = []
    for messages in prompts:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                extra_body={"return_token_ids": True})
        out.append(tuple(answer.choices[0].token_ids))
        assert answer.model == model, (answer.model, model)
    return out


@pytest.mark.on_servers
@pytest.mark.quick_on("hf", reason="the model field, /v1/models and /infer/'s adapter_request are the served engine's "
                                   "own code, alike on every backend; HF's server starts in seconds")
def test_the_model_field_picks_an_adapter_as_vllm_serve_does(lora_server, lora_engines, backend):
    """The official ``openai`` client: ``GET /v1/models`` lists each adapter with the served model as its parent; a
    chat call with ``model: r8`` answers r8's in-process rows (and names r8 as its model), the served model's name its
    base rows; swift's ``adapter_request`` on ``/infer/`` picks a loaded adapter, an unknown name is refused by
    field."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    base = next(name for name, card in cards.items() if getattr(card, "parent", None) is None)
    assert {name: getattr(cards[name], "parent", None) for name in NAMES} == {name: base for name in NAMES}
    prompts = messages()[:3]
    local = lora_engines[backend].local
    for model, adapter in ((NAMES[0], NAMES[0]), (base, None)):
        want = [r.token_ids for r in local.generate(prompts, options=OPTIONS, adapter=adapter)]
        assert chat_ids(client, model, prompts) == want, (backend, model)
    infer = {"infer_requests": [{"messages": m} for m in prompts], "adapter_request": {"name": "r16", "path": "/x"},
             "request_config": {"max_tokens": 24, "temperature": 0, "return_details": True}}
    answer = httpx.post(f"{lora_server.url}/infer/", json=infer, timeout=120).json()
    items = [item.get("response", item) for item in answer]
    want = [r.token_ids for r in local.generate(prompts, options=OPTIONS, adapter="r16")]
    assert [tuple(i["choices"][0]["token_ids"]) for i in items] == want
    refused = httpx.post(f"{lora_server.url}/infer/", json={**infer, "adapter_request": {"name": "r64", "path": "/x"}},
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "adapter_request.name", refused.text


@pytest.mark.on_servers
@pytest.mark.quick_on("vllm", reason="vLLM keys its prefix cache by adapter name and path: a reload in place is where "
                                     "an answer could come from the old weights' blocks")
def test_load_reload_in_place_and_unload_over_vllms_routes(lora_server, lora_engines, backend, tmp_path, pool):
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, bodies and answers as ``vllm serve``'s: a
    folder loaded as ``live`` answers its rows; new weights written into the same folder and loaded in place answer
    the new rows, never the old ones' cached blocks (the same prompts asked before and after); a second load without
    ``load_inplace`` is a 400; after the unload the name is a 404, and unloading it again too."""
    import shutil

    import httpx
    import openai

    url, folder = lora_server.url, tmp_path / "live"
    source = {name: pool.model_for(backend, path) for name, path in adapter_folders().items()}  # llama.cpp: GGUF twins
    shutil.copytree(source["r16"], folder)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompts, local = messages()[:3], lora_engines[backend].local
    want = {name: [r.token_ids for r in local.generate(prompts, options=OPTIONS, adapter=name)] for name in NAMES}

    def post(route, body):
        return httpx.post(f"{url}/v1/{route}", json=body, timeout=120)

    loaded = post("load_lora_adapter", {"lora_name": "live", "lora_path": str(folder)})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'live' added successfully.", loaded.text
    assert chat_ids(client, "live", prompts) == want["r16"]
    again = post("load_lora_adapter", {"lora_name": "live", "lora_path": str(folder)})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
    shutil.rmtree(folder)
    shutil.copytree(source["r8"], folder)  # new weights, the same name and path
    inplace = post("load_lora_adapter", {"lora_name": "live", "lora_path": str(folder), "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    assert chat_ids(client, "live", prompts) == want["r8"], "a reload in place answered from the old weights"
    gone = post("unload_lora_adapter", {"lora_name": "live"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'live' removed successfully.", gone.text
    with pytest.raises(openai.NotFoundError):
        chat_ids(client, "live", prompts[:1])
    missing = post("unload_lora_adapter", {"lora_name": "live"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == \
        "The lora adapter 'live' cannot be found.", missing.text


@pytest.mark.on_servers
@pytest.mark.quick_on("vllm", reason="the server that could die is vLLM's (LoRA on a CPU host); its LoRA server is "
                                     "up for this module's other vLLM checks")
def test_echoed_prompt_scoring_on_a_lora_server_never_takes_it_down(lora_server, lora_engines, backend):
    """``/v1/completions`` with ``echo`` and ``logprobs`` (lm-eval's loglikelihood request) for the base model on a
    server with adapters loaded: answered with the base model's scores where the backend scores with LoRA on, else
    a 400 naming why (vLLM on a CPU host: vllm#29955, whose crash took the engine core down); the server answers
    ``/health`` and generates after it either way."""
    import httpx

    url = lora_server.url
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    base = next(card["id"] for card in cards if card.get("parent") is None)
    body = {"model": base, "prompt": "The capital of France is Paris.", "max_tokens": 0, "echo": True, "logprobs": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    caps = lora_engines[backend].local.backend.capabilities
    if caps.scoring_problem is not None:
        assert answer.status_code == 400 and "vllm#29955" in answer.text, answer.text
    elif caps.scoring:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["logprobs"]["token_logprobs"][1] is not None
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    again = httpx.post(f"{url}/v1/completions", json={"model": base, "prompt": "Hello", "max_tokens": 4,
                                                      "temperature": 0}, timeout=120)
    assert again.status_code == 200, again.text


GUARD_XARGS = {"repeat_terminate.enabled": True, "repeat_terminate.max_consecutive_token_repeats": 2,
               "repeat_terminate.ngram_size": 2, "repeat_terminate.ngram_repeats": 2}
"""The guard of test_stops_min_length_and_the_repeat_guard_hold_with_an_adapter, as the plugin's per-request keys."""


@pytest.mark.on_servers  # among the module's served checks: an in-process check ran first and started (and stopped)
# the LoRA servers an extra time (the gate at bd5bd4e started each backend's twice, and vLLM's text server once more)
@pytest.mark.gate_only(reason="test_the_model_field_picks_an_adapter_as_vllm_serve_does carries the served adapter "
                              "path; a stock vllm serve with LoRA beside ours is a second vLLM server (about 35 s)")
def test_stock_vllm_serve_with_lora_modules_and_the_guard_plugin_answers_as_ours(pool, backend_names, text_model,
                                                                                 lora, lora_engines, summary_note):
    """Stock ``vllm serve --enable-lora --lora-modules r8=... r16=...`` with the guard's plugin
    (``--logits-processors``), beside the suite's vLLM server with the same adapters: the same chat requests naming
    r8, r16 and the base model answer the same token ids on both (and the in-process engine's); the guard plugin with
    adapter r16 active ends the looping row where the in-process guarded engine with r16 does. What stock vLLM does
    with a base request that lands in a batch beside an adapter request on CPU (the last adapter's rows:
    docs/divergences.md) is written into the summary, not asserted: whether two concurrent requests share a step
    is the scheduler's."""
    import concurrent.futures

    import httpx
    import openai

    from conformance.subjects.stock import start_vllm_serve
    from engine.vllm_plugin import PROCESSOR

    if "vllm" not in backend_names:
        pytest.skip(f"stock vllm serve runs vLLM; backends here: {backend_names}")
    key, config = pool.servers.served_config("vllm", text_model, **lora())
    ours = pool.servers.server(key, config)
    name = openai.OpenAI(base_url=f"{ours.url}/v1", api_key="none").models.list().data[0].id
    modules = [f"{n}={p}" for n, p in adapter_folders().items()]
    theirs = start_vllm_serve(config, name, extra=["--enable-lora", "--lora-modules", *modules, "--max-lora-rank",
                                                   "16", "--max-loras", "2", "--logits-processors", PROCESSOR])
    try:
        clients = {side: openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
                   for side, server in (("stock", theirs), ("ours", ours))}
        prompts, local = messages()[:3], lora_engines["vllm"].local
        for model, adapter in (("r8", "r8"), ("r16", "r16"), (name, None)):
            want = [r.token_ids for r in local.generate(prompts, options=OPTIONS, adapter=adapter)]
            for side, client in clients.items():
                assert chat_ids(client, model, prompts) == want, (side, model)
        looping = messages()[4]
        guarded = pool.engine("vllm", text_model, **lora(repeat_terminate={
            k.split(".")[1]: v for k, v in GUARD_XARGS.items()})).local
        want = guarded.generate([looping], options={"max_new_tokens": 48}, adapter="r16")[0]
        assert want.stop_reason == "repeat_terminate", "the guard must end this row with r16 for the check to see it"
        body = {"model": "r16", "prompt": list(want.prompt_token_ids), "max_tokens": 48, "temperature": 0,
                "return_token_ids": True, "vllm_xargs": GUARD_XARGS}
        answer = httpx.post(f"{theirs.url}/v1/completions", json=body, timeout=300).json()
        assert tuple(answer["choices"][0]["token_ids"]) == tuple(want.token_ids), answer["choices"][0]

        base_alone = chat_ids(clients["stock"], name, prompts[:1])[0]
        with concurrent.futures.ThreadPoolExecutor(4) as pool_:
            mixed = [pool_.submit(chat_ids, clients["stock"], model, prompts[:1])
                     for model in (name, "r16", name, "r16")]
            base_rows = [mixed[0].result()[0], mixed[2].result()[0]]
            mixed[1].result(), mixed[3].result()
        moved = sum(row != base_alone for row in base_rows)
        summary_note(f"stock vllm serve (vLLM {local.backend.version}, CPU host: {local.backend.lora.cpu}): "
                     f"{moved}/2 base requests sent beside r16 requests answered other ids than the base request "
                     f"alone")
    finally:
        theirs.stop()


@pytest.mark.on_servers
@pytest.mark.quick_on("hf", reason="TRL's client is the same against every server; HF's adapter server is the one the "
                                   "quick tier starts for this module's model-field check")
def test_trls_async_grpo_loads_its_lora_policy_and_generates_with_it(lora_server, lora_engines, backend, pool):
    """TRL 1.16's async GRPO against the served engine, as its trainer and rollout worker run (``conformance/
    trl_probe.py``, TRL's own code in its own environment): ``/server_info`` reports ``lora_config``, so TRL's own
    ``select_adapter_sync`` picks adapter-only sync for a PEFT policy; its client loads the adapter under a versioned
    name; the worker's ``/v1/completions`` body naming that version answers the in-process rows of that adapter, with
    their logprobs; after TRL's unload the name is a 404."""
    import json
    import subprocess
    import sys

    from conformance.test_logprobs_mode import TRL_VERSION, trl_environment

    env = trl_environment()
    if env is None:
        pytest.skip(f"TRL {TRL_VERSION} is installed by nox -s conformance (ENGINE_TRL_PATH) or in the vLLM 0.31 venv "
                    "of nox -s vllm-versions; this environment has neither")
    want = lora_engines[backend].local.generate(messages()[:1], options={"max_new_tokens": 16, "logprobs": 0},
                                                adapter="r16")[0]
    served_path = pool.model_for(backend, adapter_folders()["r16"])  # what the server loads (llama.cpp: the twin)
    job = {"mode": "async_grpo_lora", "url": lora_server.url, "base": pool.options.model,
           "lora_path": adapter_folders()["r16"], "served_path": served_path, "prompt": list(want.prompt_token_ids),
           "max_tokens": 16}
    done = subprocess.run([sys.executable, "-m", "conformance.trl_probe"], input=json.dumps(job), env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"TRL's client failed:\n{done.stderr[-3000:]}"
    answer = json.loads(done.stdout)
    assert answer["trl"].startswith(TRL_VERSION) and answer["adapter_sync"] is True, answer
    assert answer["lora_config"]["max_lora_rank"] >= 16 and answer["model"] == "trl-policy-v1"
    assert tuple(answer["token_ids"]) == want.token_ids
    chosen = [step[token] for step, token in zip(want.logprobs, want.token_ids, strict=True)]
    assert max(abs(a - b) for a, b in zip(answer["token_logprobs"], chosen, strict=True)) < 1e-3
    assert answer["after_unload"] == 404


@pytest.mark.on_servers
@pytest.mark.quick_on("vllm", reason="swift's trainer syncs its adapter into a vLLM rollout server, where the tensors "
                                     "arrive in the engine core's workers; HF's receiving is its weight-sync path")
def test_a_learner_pushes_its_adapter_alone_as_swifts_trainer_does(lora_server, lora_engines, backend):
    """Adapter-only weight sync (``/update_adapter_flattened_param/``, ``/update_adapter_param/``): the learner
    (this process; swift's own ``peft_config_to_dict`` and ``FlattenedTensorBucket``, PEFT's ``LoraConfig``) pushes
    r8's tensors as one bucket, then swift's client resets the prefix cache as its trainer does after a sync:
    ``/infer/`` without ``adapter_request`` answers r8's in-process rows, as swift's ``GRPOVllmEngine`` uses its
    loaded adapter. Then r16's tensors, one broadcast each, under the same name: the same prompts answer r16's rows,
    never the first push's cached blocks. ``/v1/models`` lists the pushed adapter with its parent; once it is
    unloaded ``/infer/`` answers the base rows again. llama.cpp is refused by name."""
    import httpx
    from peft import LoraConfig
    from safetensors.torch import load_file
    from swift.rlhf_trainers.utils import FlattenedTensorBucket, peft_config_to_dict
    from swift.rlhf_trainers.vllm_client import VLLMClient

    from engine.adapters import SYNCED
    from engine.weights.sync import WeightSyncClient

    url, prompts = lora_server.url, messages()[:3]
    folders = adapter_folders()
    peft_configs = {name: peft_config_to_dict(LoraConfig.from_pretrained(folders[name])) for name in NAMES}
    if backend == "llamacpp":  # no weight loading there: refused by name before anything joins
        reply = httpx.post(f"{url}/update_adapter_param/", json={"peft_config": peft_configs["r8"],
                                                                "lora_tensors_metadata": [{"name": "x.lora_A.weight",
                                                                                           "dtype": "torch.float32",
                                                                                           "shape": [8, 576]}]})
        assert reply.status_code == 400 and "cannot load a learner's weights" in reply.text, reply.text
        return
    local = lora_engines[backend].local
    want = {name: [r.token_ids for r in local.generate(prompts, options=OPTIONS, adapter=name)]
            for name in (None, *NAMES)}
    infer = {"infer_requests": [{"messages": m} for m in prompts],
             "request_config": {"max_tokens": OPTIONS["max_new_tokens"], "temperature": 0, "return_details": True}}

    def answers():
        items = httpx.post(f"{url}/infer/", json=infer, timeout=300).json()
        return [tuple(item.get("response", item)["choices"][0]["token_ids"]) for item in items]

    assert answers() == want[None], "before any push /infer/ answers the base model"
    tensors = {name: load_file(str(Path(folders[name]) / "adapter_model.safetensors")) for name in NAMES}
    try:
        with WeightSyncClient(url, transport="tcp") as sync:
            bucket = FlattenedTensorBucket(named_tensors=list(tensors["r8"].items()))
            sync.update_adapter_flattened_param(peft_configs["r8"], bucket.get_metadata(),
                                                bucket.get_flattened_tensor())
            swift = VLLMClient(base_urls=[url], connection_timeout=30)
            swift.reset_prefix_cache()
            assert answers() == want["r8"], "after pushing r8, /infer/ does not answer r8's rows"
            sync.update_adapter_param(peft_configs["r16"], tensors["r16"])
            swift.reset_prefix_cache()
            assert answers() == want["r16"], "the second push answered from the first push's adapter"
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert cards[SYNCED]["parent"] is not None and cards[SYNCED]["parent"] in cards, cards
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": SYNCED}, timeout=120)
    assert answers() == want[None], "after the pushed adapter is unloaded /infer/ answers the base model"
