"""The sampling-distribution rule (``engine.rules.processing``) on small synthetic rows: vLLM's order and rules."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from engine.rules.processing import Processing, kept_mass, process, reprocess, truncate  # noqa: E402


def test_top_k_keeps_ties_and_top_p_keeps_the_likeliest():
    row = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    assert truncate(row.clone(), top_k=1, top_p=1.0).isfinite().tolist() == [[True, True, False, False]]
    assert truncate(row.clone(), top_k=0, top_p=1e-9).isfinite().sum() == 1


def test_top_p_runs_over_what_top_k_kept():
    """vLLM applies top-p to the top-k-truncated distribution: with k=2 the two kept tokens share all the mass."""
    row = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    kept = truncate(row.clone(), top_k=2, top_p=0.6).isfinite().tolist()
    assert kept == [[True, True, False, False]]  # 0.4/0.7 = 0.57 < 0.6: the second token stays


def test_processing_order_penalty_temperature_min_p_then_truncation():
    logits = torch.tensor([3.0, 2.0, -1.0, 0.5])
    out, mass = process(logits, Processing(temperature=0.5, min_p=0.1, repetition_penalty=2.0), seen=[0])
    # penalty: 3 -> 1.5; temperature: 3.0, 4.0, -2.0, 1.0; min-p drops p < 0.1 * p_max (tokens 2 and 3)
    assert out.isfinite().tolist() == [True, True, False, False]
    assert torch.allclose(out[:2], torch.tensor([3.0, 4.0]))
    full = torch.softmax(torch.tensor([3.0, 4.0, -2.0, 1.0]), dim=-1)
    assert math.isclose(float(mass), float(full[:2].sum()), rel_tol=1e-6)
    assert logits.tolist() == [3.0, 2.0, -1.0, 0.5]  # the input is untouched


def test_reprocess_penalises_what_each_position_has_seen():
    logits = torch.zeros(2, 3)  # positions predicting sequence[1] and sequence[2]
    logits[:, 0] = 1.0
    lp, mass = reprocess(logits, Processing(repetition_penalty=2.0), sequence=[1, 0, 2], start=1)
    assert torch.allclose(lp[0], torch.log_softmax(torch.tensor([1.0, 0.0, 0.0]), dim=-1))  # only 1 seen: 0 * 2
    assert torch.allclose(lp[1], torch.log_softmax(torch.tensor([0.5, 0.0, 0.0]), dim=-1))  # 0 seen now: 1 / 2
    assert torch.allclose(mass, torch.ones(2))


def test_kept_mass_of_an_untouched_row_is_one():
    row = torch.randn(50)
    assert math.isclose(float(kept_mass(row, row)), 1.0, rel_tol=1e-6)
    assert Processing(temperature=0).is_identity and not Processing(top_k=5).is_identity


# -- one carrier: every backend translates every field of CallPlan.processing (docs/layout.md, "Add a sampling option")


def warp_fields() -> set[str]:
    """The carrier fields the shared steps after the penalty read (``processing.<field>`` in ``temper`` and ``cut``)."""
    import ast
    import inspect

    import engine.rules.processing as module

    read = set()
    for step in (module.temper, module.cut):
        for node in ast.walk(ast.parse(inspect.getsource(step))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "processing":
                read.add(node.attr)
    return read


def carrier_fields() -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(Processing)}


def translated_by(backend: str) -> set[str]:
    """The carrier fields ``backend`` hands on: to its own sampler by name, or through the shared steps."""
    from engine.rules.processing import PENALTY

    if backend == "vllm":  # vLLM's native sampler, by SamplingParams name
        from engine.backends.vllm.backend import VLLM_SAMPLING

        return set(VLLM_SAMPLING)
    if backend == "hf":  # HF's GenerationConfig for its penalty, the shared warp in RowSampler for the rest
        from engine.backends.hf.backend import HF_OWN

        return set(HF_OWN) | warp_fields()
    if backend in ("llamacpp", "portable draw"):  # the shared penalty, then the shared warp (process())
        return set(PENALTY) | warp_fields()
    raise AssertionError(backend)


@pytest.mark.parametrize("backend", ["hf", "vllm", "llamacpp", "portable draw"])
def test_every_backend_translates_every_field_of_the_carrier(backend):
    """A field added to ``Processing`` with no step in the shared warp, or no ``SamplingParams`` name on vLLM, fails
    here on each backend that would silently ignore it, by name."""
    missing = sorted(carrier_fields() - translated_by(backend))
    assert missing == [], f"{backend} does not translate {missing} of CallPlan.processing"


def test_the_carrier_is_built_once_from_the_options_and_travels_whole():
    """``CallPlan.processing`` is the options' fields of the same names; the portable draw's arguments carry every field
    and read back equal (vLLM's processors rebuild it from them)."""
    from engine.backends.base import CallPlan
    from engine.backends.vllm.portable import PortableDraw, check_draw_args, draw_args
    from engine.config import GenerationOptions, StopPolicy

    options = GenerationOptions(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.2,
                                sampler="portable", seed=1)
    plan = CallPlan(options, StopPolicy(), (2,))
    assert plan.processing == Processing(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.2)
    args = draw_args(plan, 3, 4)
    check_draw_args(args, "draw")
    assert PortableDraw.of(args, prompt=[1], terminal=[2], min_new=0).processing == plan.processing


def test_an_option_a_native_sampler_lacks_is_refused_by_name_before_generation():
    """A carrier field a backend's own sampler cannot run (``Capabilities.native_processing``, from VLLM_SAMPLING's
    None entries on vLLM) is refused with the native sampler, naming it; the portable draw runs it."""
    from types import SimpleNamespace

    from engine.backends.base import Capabilities
    from engine.config import GenerationOptions
    from engine.errors import ConfigError
    from engine.planning import plan_options

    lacking = Capabilities(name="toy", native_processing=frozenset(carrier_fields() - {"top_k"}))
    backend = SimpleNamespace(name="toy", capabilities=lacking, default_seed=None)
    with pytest.raises(ConfigError) as info:
        plan_options(GenerationOptions(temperature=1.0, top_k=3), None, backend, "raw_logprobs")
    assert info.value.field == "generation.top_k" and "portable" in str(info.value)
    assert plan_options(GenerationOptions(temperature=1.0, top_k=3, sampler="portable", seed=1), None, backend,
                        "raw_logprobs").top_k == 3
    assert plan_options(GenerationOptions(temperature=1.0), None, backend, "raw_logprobs").top_k == 0  # default: fine
