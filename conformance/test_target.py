"""A server checked through its OpenAI API against the in-process HF reference on the same model
(``conformance/subjects/target.py``): greedy text, stop strings and stop ids, ``min_tokens``, seeds, streams, logprobs,
``max_tokens`` at the context edge, refusals' shape, and what a plain OpenAI request gets by default.

The subject is ``--engine-target-url``'s server (``target``) when given, where a difference is the verdict
``differs`` (the finding in the report; ``--engine-target-strict`` fails instead); otherwise each selected backend's
own server (``python -m engine.serve``), where a difference fails. Prompts are text, tokenized as is on both sides.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.compare import exact_pair
from conformance.precision import REFERENCE_TOL
from conformance.subjects.plan import engines, servers, uses
from conformance.subjects.target import TARGET, Findings, error_shape_problem

pytestmark = pytest.mark.external_target  # what --engine-target-url runs: any server, through its OpenAI API
SUBJECTS = uses(engines("text"), servers("text"))

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "1, 2, 3, 4,")
"""Plain text prompts: greedy continuations of a few sentences, code and a list."""
QUESTION = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
"""A chat (rendered by the reference's template into the prompt text) whose answer ends early with EOS."""
TOP = 5


@pytest.fixture(scope="module")
def reference(pool: Any) -> Any:
    """The in-process HF engine on ``--engine-model``: what every answer is compared with."""
    return pool.reference("hf", pool.options.model)


@pytest.fixture
def findings(target: Any, pool: Any) -> Findings:
    """Differences found by the check, settled at its end (``Findings``): a failure on our own servers."""
    return Findings(strict=target.name != TARGET or pool.options.target.strict)


def greedy(reference: Any, prompts: list[str], max_tokens: int, **options: Any) -> list[Any]:
    return reference.complete(prompts, options={"max_new_tokens": max_tokens, "temperature": 0.0, **options})


def pieces(tokenizer: Any, ids: Any) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def exact_expected(target: Any, dtype: str) -> bool:
    """Greedy text must match exactly: an external target in float32, or our server of a backend held exact."""
    return dtype == "float32" and (target.name == TARGET or exact_pair("hf", target.name, dtype))


def chat_prompt(reference: Any) -> str:
    return reference.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)


def test_greedy_text_matches_reference(target, reference, findings, pool, summary_note):
    """Temperature 0: the same text as HF, token for token in float32; below it (and for our llama.cpp server),
    equal up to the first divergence, where each side's token is in the other's top 5 (vLLM's rule)."""
    refs = greedy(reference, list(PROMPTS), 24, logprobs=TOP)
    exact = exact_expected(target, pool.options.dtype)
    same = 0
    for i, (prompt, ref) in enumerate(zip(PROMPTS, refs, strict=True)):
        got = target.complete(prompt, max_tokens=24, temperature=0.0, logprobs=TOP)
        if got.text == ref.text:
            same += 1
            continue
        ref_pieces = pieces(reference.tokenizer, ref.token_ids)
        step = next((s for s, (a, b) in enumerate(zip(ref_pieces, got.tokens or [], strict=False)) if a != b),
                    min(len(ref_pieces), len(got.tokens or [])))
        where = f"p{i}@{step}: HF {ref.text!r}, server {got.text!r}"
        if exact or not within_rule(reference, ref, got, step):
            findings.differ(f"greedy text of prompt {i} differs from token {step} on ({where})")
    summary_note(f"greedy text {target.name} vs HF ({len(PROMPTS)} prompts, 24 tokens): {same}/{len(PROMPTS)} equal")
    findings.settle()


def within_rule(reference: Any, ref: Any, got: Any, step: int) -> bool:
    """vLLM's rule at the first divergence ``step``: the server's token among HF's top 5 there, and HF's among the
    server's (pieces compared as text: the server names tokens by their text)."""
    if got.top_logprobs is None or step >= len(ref.token_ids) or step >= len(got.top_logprobs):
        return False
    ref_top = {reference.tokenizer.decode([i]) for i in ref.logprobs[step]}
    return got.tokens[step] in ref_top and reference.tokenizer.decode([ref.token_ids[step]]) in got.top_logprobs[step]


def test_stop_strings_cut_where_reference_does(target, reference, findings):
    """A stop string taken from the middle of HF's greedy answer: the server's text is cut where HF's is (the stop
    string left out), with finish reason ``stop``."""
    words = greedy(reference, [PROMPTS[2]], 24)[0].text.split()
    stop = words[len(words) // 2]
    check_cut(target, reference, findings, f"stop {stop!r}", {"strings": [stop]}, stop=[stop])


def test_stop_token_ids_end_the_row(target, reference, findings):
    """``stop_token_ids`` (vLLM's extra field) with a token of HF's greedy answer: the row ends at it, its text left
    out, as HF ends it."""
    whole = greedy(reference, [PROMPTS[2]], 24)[0]
    stop_id = whole.token_ids[len(whole.token_ids) // 2]
    check_cut(target, reference, findings, f"stop_token_ids [{stop_id}] ({reference.tokenizer.decode([stop_id])!r})",
              {"token_ids": [stop_id]}, stop_token_ids=[stop_id])


def check_cut(target: Any, reference: Any, findings: Findings, what: str, reference_stop: dict[str, Any],
              **fields: Any) -> None:
    """The server's greedy answer to ``PROMPTS[2]`` with ``fields`` is HF's with ``reference_stop``: the same text, cut
    at the same place, and the same finish reason."""
    ref = reference.complete([PROMPTS[2]], options={"max_new_tokens": 24, "temperature": 0.0},
                             stop=reference_stop)[0]
    got = target.complete(PROMPTS[2], max_tokens=24, temperature=0.0, **fields)
    if (got.text, got.finish_reason) != (ref.text, ref.finish_reason):
        findings.differ(f"{what}: HF {ref.text!r} ({ref.finish_reason}), server {got.text!r} ({got.finish_reason})")
    findings.settle()


def test_min_tokens_hold_eos_back(target, reference, findings):
    """A chat whose greedy answer ends early with EOS, asked with ``min_tokens`` past that end: at least that many
    tokens, and the text HF gives with ``min_new_tokens``."""
    prompt = chat_prompt(reference)
    short = greedy(reference, [prompt], 32)[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 24, f"the question's answer {short.text!r} " \
        "does not end early on the reference: the check needs a model that answers it briefly"
    floor = len(short.token_ids) + 4
    ref = greedy(reference, [prompt], 32, min_new_tokens=floor)[0]
    got = target.complete(prompt, max_tokens=32, temperature=0.0, min_tokens=floor)
    if got.completion_tokens < floor:
        findings.differ(f"min_tokens {floor}: the server stopped after {got.completion_tokens} tokens "
                        f"({got.text!r}, {got.finish_reason}); HF gave {len(ref.token_ids)}")
    elif got.text != ref.text:
        findings.differ(f"min_tokens {floor}: HF {ref.text!r}, server {got.text!r}")
    findings.settle()


def test_seeded_sampling_is_reproducible(target, findings):
    """The same seeded sampled request twice gives the same text; another seed gives another text on at least one
    of two prompts (the seed is read, not ignored). Samplers differ by server, so HF is not the reference here."""
    fields = {"max_tokens": 12, "temperature": 1.0, "top_p": 1.0}
    firsts = [target.complete(p, seed=1234, **fields).text for p in PROMPTS[:2]]
    again = [target.complete(p, seed=1234, **fields).text for p in PROMPTS[:2]]
    others = [target.complete(p, seed=4321, **fields).text for p in PROMPTS[:2]]
    if firsts != again:
        findings.differ(f"seed 1234 twice gave different texts: {firsts} then {again}")
    if firsts == others:
        findings.differ(f"seeds 1234 and 4321 gave the same texts on two prompts ({firsts}): the seed is ignored")
    findings.settle()


def test_stream_equals_whole_answer(target, findings):
    """A streamed answer, joined, is the whole answer to the same greedy request, with its finish reason."""
    for prompt in PROMPTS[:2]:
        whole = target.complete(prompt, max_tokens=20, temperature=0.0)
        text, reason = target.stream(prompt, max_tokens=20, temperature=0.0)
        if (text, reason) != (whole.text, whole.finish_reason):
            findings.differ(f"stream of {prompt!r}: {text!r} ({reason}), whole {whole.text!r} ({whole.finish_reason})")
    findings.settle()


def test_logprobs_within_float32_bound(target, reference, findings, pool):
    """``logprobs: 1``: the chosen tokens' log-probabilities within 1e-3 of HF's (float32) on every step both chose
    the same token."""
    if pool.options.dtype != "float32":
        pytest.skip("the bound below float32 is calibrated from each side's own float32 error "
                    "(conformance/precision.py), which cannot be measured from outside a server")
    refs = greedy(reference, list(PROMPTS[:2]), 12, logprobs=1)
    for i, (prompt, ref) in enumerate(zip(PROMPTS[:2], refs, strict=True)):
        got = target.complete(prompt, max_tokens=12, temperature=0.0, logprobs=1)
        if got.token_logprobs is None or got.tokens is None:
            findings.differ(f"prompt {i}: no logprobs in the answer")
            continue
        for step, (token, value) in enumerate(zip(got.tokens, got.token_logprobs, strict=True)):
            if step >= len(ref.token_ids) or reference.tokenizer.decode([ref.token_ids[step]]) != token:
                break
            expected = ref.logprobs[step][ref.token_ids[step]]
            if abs(value - expected) > REFERENCE_TOL:
                findings.differ(f"prompt {i} step {step} ({token!r}): server {value:.6f}, HF {expected:.6f}")
                break
    findings.settle()


def test_max_tokens_at_the_context_edge(target, reference, findings):
    """A prompt that leaves 3 tokens of the context: ``max_tokens: 3`` gets them; ``max_tokens: 4`` gets the same 3
    tokens with finish reason ``length`` (the engine's rule, and vLLM's since it caps ``max_tokens`` at the
    context), or a 4xx in the OpenAI shape; never a 5xx, never a token past the context."""
    context = target.context_length()
    if context is None:
        pytest.skip("the server's context length is unknown (its /v1/models has no max_model_len): give "
                    "--engine-target-context")
    word = " hello"
    assert len(reference.tokenizer.encode(word * 3, add_special_tokens=False)) == 3
    prompt = "Hi" + word * (context - 4)
    n = len(reference.tokenizer.encode(prompt, add_special_tokens=False))
    assert n == context - 3, f"the edge prompt has {n} tokens, not {context - 3}"
    got = target.complete(prompt, max_tokens=3, temperature=0.0)
    if got.prompt_tokens != n:
        findings.differ(f"the edge prompt counted {got.prompt_tokens} prompt tokens on the server, {n} on HF")
    elif got.completion_tokens != 3 or got.finish_reason != "length":
        findings.differ(f"max_tokens 3 at the edge: {got.completion_tokens} tokens, {got.finish_reason}")
    status, body = target.refused({"model": target.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                   **target.extra_body})
    if status == 200:
        usage, choice = body.get("usage") or {}, (body.get("choices") or [{}])[0]
        if (usage.get("completion_tokens"), choice.get("finish_reason")) != (3, "length"):
            findings.differ(f"max_tokens 4 past the context ({n} + 4 > {context}): {usage.get('completion_tokens')} "
                            f"tokens, finish reason {choice.get('finish_reason')!r} (the engine: 3, 'length')")
    elif problem := error_shape_problem(status, body):
        findings.differ(f"max_tokens 4 past the context ({n} + 4 > {context}) {problem}")
    findings.settle()


BAD_BODIES = {
    "max_tokens": -1,
    "temperature": -0.5,
    "top_p": 1.5,
    "logprobs": -1,
    "n": 0,
    "stop": 7,
}
"""Fields whose value every OpenAI-compatible server should refuse (one per request, all else valid)."""


def test_bad_input_gets_an_openai_error(target, findings):
    """Each invalid field, and an unknown model, is refused with a 4xx whose body is ``{"error": {"message": ...}}``
    (the OpenAI API's shape, which the ``openai`` client reads), never accepted or answered with a 5xx."""
    base = {"model": target.model, "prompt": PROMPTS[0], "max_tokens": 4, **target.extra_body}
    cases = {f"{k}={v!r}": {**base, k: v} for k, v in BAD_BODIES.items()}
    cases["model='no-such-model'"] = {**base, "model": "no-such-model"}
    cases["no prompt"] = {k: v for k, v in base.items() if k != "prompt"}
    for what, body in cases.items():
        problem = error_shape_problem(*target.refused(body))
        if problem:
            findings.differ(f"{what} {problem}")
    findings.settle()


def test_plain_request_is_greedy_at_temperature_zero(target, reference, findings):
    """What a plain OpenAI client gets, without ``--engine-target-extra-body``: ``temperature: 0`` and no other
    sampling field gives HF's greedy text (no default penalty or sampler of the server's own)."""
    prompt = PROMPTS[2]
    ref = greedy(reference, [prompt], 24)[0]
    got = target.complete(prompt, plain=True, max_tokens=24, temperature=0.0)
    if got.text != ref.text:
        findings.differ(f"a plain request (temperature 0, no extra fields): HF {ref.text!r}, server {got.text!r}")
    findings.settle()
