"""No backend silently ignores an option: every field of ``GenerationOptions`` and ``StopPolicy``, set to a value
other than its default, changes every backend's output exactly as it changes HF's, or is refused by name before
generation; in-process and through ``POST /v1/completions``.

The fields are read from the two dataclasses, so a new field with no case here fails collection, naming the field.
Each case is a pair of calls, ``base`` (the field at its default) and ``changed`` (the field set), derived from HF's
greedy rows (the probe), so that a stop string or a stop id is one that really occurs. Every case checks, on HF, that
the change changes the output (the case has teeth); then every backend's changed rows must equal HF's (float32:
equal field by field, the suite's rule) and its base rows too (so a backend that dropped the field, answering the base
rows for the changed call, cannot pass). Fields that only sample are compared through the portable sampler
(``generation.sampler: portable``: the same seeded rows on every backend), near-ties aside as
``test_portable_sampler.py`` accepts them.

A field with enumerated values (:data:`CHOICES`: the sampler, the logprobs mode) has a case for every value, each
compared across backends: ``portable_fp64``'s rows are compared on every backend as ``portable``'s are (a backend that
quietly drew them in float32 would answer ``portable``'s rows), the engine's own logprobs mode answers the rows
without it, and every other mode is refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from conformance.compare import RESULT_FIELDS, first_divergence
from conformance.precision import REFERENCE_TOL
from conformance.subjects.plan import engines, servers, uses
from engine.config.generation import LOGPROBS_MODES, SAMPLERS, GenerationOptions, StopPolicy
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"), servers("text"))

FIELDS: tuple[str, ...] = (*(f"generation.{f.name}" for f in dataclasses.fields(GenerationOptions)),
                           *(f"stop.{f.name}" for f in dataclasses.fields(StopPolicy)))
"""Every option a call can set, by its engine name (what errors name)."""
PROMPTS = [p["messages"] for p in load_prompts("chat")[:4]]
TOKENS = 12
"""The base calls' budget; the EOS cases (``ignore_eos``, ``min_new_tokens``) take :data:`LONG`."""
LONG = 40
PROCESSING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The options a portable row's near-tie is re-scored under (``engine.rules.processing.Processing``)."""
SAMPLED = {"max_new_tokens": TOKENS, "temperature": 1.0, "sampler": "portable", "seed": 17}


@dataclass(frozen=True)
class Call:
    """One engine call's options and stop policy (engine field names)."""

    options: Mapping[str, Any]
    stop: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Case:
    """A field's non-default value: ``changed`` sets it, ``base`` is the same call without it. ``refused``: every
    backend must refuse ``changed`` by naming the field (the value cannot hold on the engines the suite starts).
    ``comparable_base``: whether the base rows are the same on every backend (not with the native sampler)."""

    base: Call
    changed: Call
    refused: bool = False
    comparable_base: bool = True
    sampled: bool = False
    same_as_base: bool = False
    """The value is what the engine does without it (the served logprobs mode): every backend answers the base rows."""


@dataclass(frozen=True)
class Probe:
    """HF's greedy rows of :data:`PROMPTS`: ``short`` at :data:`TOKENS` tokens, ``long`` at :data:`LONG`."""

    short: Sequence[Any]
    long: Sequence[Any]
    tokenizer: Any = field(repr=False)

    def stop_string(self) -> str:
        """A string row 0 holds after its first tokens (so the stop ends it inside the budget)."""
        row = self.short[0]
        text = self.tokenizer.decode(list(row.token_ids[3:5])).strip()
        assert text and text in row.text[1:], f"probe row 0 {row.text!r}: no stop string after its first tokens"
        return text

    def eos_row_length(self) -> int:
        """The shortest length of a long row that ended at EOS (the EOS cases need one)."""
        ended = [len(r.token_ids) for r in self.long if r.finish_reason == "stop"]  # no stops asked: EOS
        assert ended, f"no probe row ended at EOS within {LONG} tokens: the EOS cases have no teeth"
        return min(ended)


def sampled(**changes: Any) -> Case:
    return Case(Call(SAMPLED), Call({**SAMPLED, **changes}), sampled=True)


def greedy(**changes: Any) -> Case:
    return Case(Call({"max_new_tokens": TOKENS}), Call({"max_new_tokens": TOKENS, **changes}))


RAW_MODE = "raw_logprobs"
"""The logprobs mode of the suite's engines (``model.logprobs_mode``'s default)."""


def logprobs_mode(mode: str) -> Case:
    base = Call({"max_new_tokens": TOKENS, "logprobs": 2})
    return Case(base, Call({**base.options, "logprobs_mode": mode}), refused=mode != RAW_MODE,
                same_as_base=mode == RAW_MODE)


CASES: dict[str, Callable[[Probe], Case | tuple[Case, ...]]] = {
    "generation.max_new_tokens": lambda p: Case(Call({"max_new_tokens": TOKENS}), Call({"max_new_tokens": 5})),
    "generation.temperature": lambda p: Case(Call({"max_new_tokens": TOKENS}), Call({**SAMPLED, "temperature": 0.7}),
                                             sampled=True),
    "generation.top_p": lambda p: sampled(top_p=0.6),
    "generation.top_k": lambda p: sampled(top_k=3),
    "generation.min_p": lambda p: sampled(min_p=0.1),
    "generation.seed": lambda p: sampled(seed=18),
    "generation.sampler": lambda p: tuple(Case(Call({**SAMPLED, "sampler": "native"}), Call({**SAMPLED, "sampler": s}),
                                               comparable_base=False, sampled=True) for s in SAMPLERS if s != "native"),
    "generation.repetition_penalty": lambda p: greedy(repetition_penalty=1.5),
    "generation.min_new_tokens": lambda p: Case(Call({"max_new_tokens": LONG}),
                                                Call({"max_new_tokens": LONG,
                                                      "min_new_tokens": p.eos_row_length() + 3})),
    "generation.logprobs": lambda p: greedy(logprobs=3),
    "generation.ignore_eos": lambda p: Case(Call({"max_new_tokens": LONG}),
                                            Call({"max_new_tokens": LONG, "ignore_eos": True})),
    "generation.logprobs_mode": lambda p: tuple(logprobs_mode(m) for m in LOGPROBS_MODES),
    "stop.strings": lambda p: Case(Call({"max_new_tokens": TOKENS}),
                                   Call({"max_new_tokens": TOKENS}, {"strings": [p.stop_string()]})),
    "stop.token_ids": lambda p: Case(Call({"max_new_tokens": TOKENS}),
                                     Call({"max_new_tokens": TOKENS}, {"token_ids": [p.short[0].token_ids[4]]})),
    "stop.include_stop_str": lambda p: Case(Call({"max_new_tokens": TOKENS}, {"strings": [p.stop_string()]}),
                                            Call({"max_new_tokens": TOKENS},
                                                 {"strings": [p.stop_string()], "include_stop_str": True})),
}
"""Each field's case, or one case per value of an enumerated field (:data:`CHOICES`). ``logprobs_mode``: the suite's
engines serve raw logprobs, so a request naming that mode answers as without it, and one expecting another mode is
refused rather than given raw ones (``test_logprobs_mode.py`` covers the engines of the other modes)."""

CHOICES: dict[str, tuple[str, ...]] = {"generation.sampler": SAMPLERS, "generation.logprobs_mode": LOGPROBS_MODES}
"""The fields whose values are a closed set: every value needs a case of its own (collection fails otherwise)."""


def cases_of(made: Case | tuple[Case, ...]) -> tuple[Case, ...]:
    return made if isinstance(made, tuple) else (made,)


def values_without_a_case(name: str, cases: Sequence[Case]) -> list[str]:
    """The values of enumerated field ``name`` that no case sets (the default counts: it is every base call's).

    >>> values_without_a_case("generation.sampler", [Case(Call({"sampler": "native"}), Call({"sampler": "portable"}))])
    ['portable_fp64']
    """
    key = name.split(".", 1)[1]
    default = {f.name: f.default for f in dataclasses.fields(GenerationOptions)}.get(key)
    covered = {default} | {c.changed.options.get(key) for c in cases} | {c.base.options.get(key) for c in cases}
    return [v for v in CHOICES[name] if v not in covered]


def uncovered(fields: Sequence[str], cases: Mapping[str, Any]) -> list[str]:
    """The fields with no case (collection fails on any), and cases of fields that no longer exist.

    >>> uncovered(["generation.top_k", "generation.new_knob"], {"generation.top_k": None, "stop.gone": None})
    ['generation.new_knob (no case)', 'stop.gone (no such field)']
    """
    return ([f"{f} (no case)" for f in fields if f not in cases]
            + [f"{c} (no such field)" for c in cases if c not in fields])


if uncovered(FIELDS, CASES):
    raise TypeError(f"conformance/test_option_coverage.py: {', '.join(uncovered(FIELDS, CASES))}: every option "
                    "needs a case in CASES (a non-default value, and the call without it), or this check cannot tell "
                    "whether every backend honours it")
_STAND_IN = Probe(short=(), long=(), tokenizer=None)  # what the enumerated fields' cases are built from: no probe
for _name in CHOICES:
    if values_without_a_case(_name, cases_of(CASES[_name](_STAND_IN))):
        raise TypeError(f"conformance/test_option_coverage.py: {_name}'s values "
                        f"{values_without_a_case(_name, cases_of(CASES[_name](_STAND_IN)))} have no case: each value "
                        "of an enumerated option is compared across backends, not only the field")


def rows_differ(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return any(getattr(x, f) != getattr(y, f) for x, y in zip(a, b, strict=True) for f in (*RESULT_FIELDS, "logprobs"))


def same_rows(want: Sequence[Any], got: Sequence[Any], *, what: str, case: Case, reference: Any, call: Call,
              fields: Sequence[str] = RESULT_FIELDS) -> list[str]:
    """Where ``got`` parts from ``want`` (HF's rows): failures, each named. A sampled row may part at a near-tie of
    the portable draw (``test_portable_sampler.near_tie``); logprobs: the same count per step, values within
    REFERENCE_TOL."""
    from conformance.test_portable_sampler import NEAR_TIE, near_tie
    from engine.rules.seeding import row_seed

    failures = []
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        step = first_divergence(w.token_ids, g.token_ids)
        if step is not None and case.sampled and call.options.get("sampler") in ("portable", "portable_fp64"):
            processing = {k: v for k, v in call.options.items() if k in PROCESSING}
            margin = near_tie(reference, w.prompt_token_ids, w.token_ids, g.token_ids, step, processing,
                              row_seed(call.options["seed"], i), fp64=call.options["sampler"] == "portable_fp64")
            if abs(margin) <= NEAR_TIE:
                continue  # the same distribution, drawn apart by float32 rounding of a tie
        for name in fields:
            if getattr(w, name) != getattr(g, name):
                failures.append(f"{what} row {i} {name}: HF {getattr(w, name)!r} vs {getattr(g, name)!r}")
                break
        else:
            failures += logprob_failures(w.logprobs, g.logprobs, f"{what} row {i}")
    return failures


def logprob_failures(want: Any, got: Any, what: str) -> list[str]:
    if (want is None) != (got is None):
        return [f"{what}: logprobs {'missing' if got is None else 'not asked for'}"]
    failures = []
    for step, (w, g) in enumerate(zip(want or (), got or (), strict=True)):
        if len(w) != len(g):
            failures.append(f"{what} step {step}: {len(g)} logprobs, HF {len(w)}")
        common = set(w) & set(g)
        worst = max((abs(w[t] - g[t]) for t in common if math.isfinite(w[t])), default=0.0)
        if not common or worst > REFERENCE_TOL:
            failures.append(f"{what} step {step}: logprobs {g} vs HF {w}")
    return failures[:3]


@pytest.fixture(scope="module")
def probe(engines: dict[str, Any]) -> Probe:
    hf = engines.get("hf") or pytest.skip("the option-coverage check compares every backend with HF; select hf")
    return Probe(hf.generate(PROMPTS, options={"max_new_tokens": TOKENS}),
                 hf.generate(PROMPTS, options={"max_new_tokens": LONG}), hf.tokenizer)


def run(engine: Any, call: Call, prompts: Sequence[Any] = PROMPTS) -> list[Any]:
    return engine.generate(prompts, options=dict(call.options), stop=None if call.stop is None else dict(call.stop))


def case_failures(name: str, case: Case, engines: Mapping[str, Any]) -> list[str]:
    """Where a backend's rows for ``case`` part from HF's (changed and, where comparable, base); asserts first that
    the change changes HF's rows."""
    reference = engines["hf"]
    want_base, want = run(reference, case.base), run(reference, case.changed)
    assert rows_differ(want_base, want), f"{name}: the case changes nothing on HF, so it cannot catch a backend that " \
        f"drops {name}: {[r.text for r in want]}"
    failures = []
    for b, e in engines.items():
        if b == "hf":
            continue
        failures += same_rows(want, run(e, case.changed), what=f"{b} {name}={case.changed}", case=case,
                              reference=reference, call=case.changed)
        if case.comparable_base:
            failures += same_rows(want_base, run(e, case.base), what=f"{b} without {name}", case=case,
                                  reference=reference, call=case.base)
    return failures


@pytest.mark.parametrize("name", FIELDS)
def test_every_backend_honours_the_option_as_hf_does_or_refuses_it(name, engines, probe, pool, count_backend_calls):
    """In-process: the field's non-default value changes HF's rows, and every other backend answers HF's rows with
    and without it; or every backend refuses it, naming it, before generating."""
    from engine.errors import ConfigError, RequestError

    cases = cases_of(CASES[name](probe))
    if pool.options.dtype != "float32":
        pytest.skip("the rows are compared exactly, float32's promise (in bfloat16 the parity checks hold backends "
                    "to vLLM's rule)")
    failures = []
    for case in cases:
        if case.refused:
            for b, e in engines.items():
                calls = count_backend_calls(e)
                with pytest.raises((ConfigError, RequestError)) as info:
                    run(e, case.changed)
                assert info.value.field == name, f"{b}: refused naming {info.value.field!r}, not {name}: {info.value}"
                assert calls == [], f"{b}: the refused call generated tokens"
        elif case.same_as_base:
            want = run(engines["hf"], case.base)
            for b, e in engines.items():
                failures += same_rows(want, run(e, case.changed), what=f"{b} {name}={case.changed}", case=case,
                                      reference=engines["hf"], call=case.changed)
        else:
            failures += case_failures(name, case, engines)
    if len(cases) > 1 and not any(c.refused or c.same_as_base for c in cases):  # each value its own rows on HF
        rows = [run(engines["hf"], c.changed) for c in cases]
        assert all(rows_differ(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]), (
            f"{name}: two of its values give HF the same rows, so a backend that swapped them would pass")
    assert not failures, f"{name}: a backend does not do what HF does with it:\n" + "\n".join(failures)


DROPPED = ("generation.min_p", "generation.repetition_penalty", "generation.min_new_tokens", "generation.top_k")
"""Options the teeth check drops on one backend (each read by the backend from its plan)."""


@pytest.mark.parametrize("name", DROPPED)
def test_the_check_fails_when_one_backend_drops_an_option(name, engines, probe, pool, monkeypatch):
    """The check's teeth: one backend whose adapter receives the plan with ``name`` back at its default (as an adapter
    that forgot to copy it would run) fails the comparison above, naming that backend."""
    if pool.options.dtype != "float32":
        pytest.skip("the rows are compared exactly, float32's promise")
    victim = [b for b in engines if b != "hf"][-1]
    field_name = name.removeprefix("generation.")
    default = {f.name: f.default for f in dataclasses.fields(GenerationOptions)}[field_name]
    original = engines[victim].backend.generate

    def dropping(prompts: Any, plan: Any) -> Any:
        return original(prompts, dataclasses.replace(
            plan, options=dataclasses.replace(plan.options, **{field_name: default})))

    monkeypatch.setattr(engines[victim].backend, "generate", dropping)
    failures = [f for case in cases_of(CASES[name](probe)) for f in case_failures(name, case, engines)]
    assert any(f.startswith(f"{victim} {name}") for f in failures), (
        f"{victim} ran without {name} and the check did not notice: {failures}")


def body_of(call: Call, prompts: Sequence[Sequence[int]], model: str) -> dict[str, Any]:
    """``call`` as a ``/v1/completions`` body: each engine field under the client field the server's own table names
    (``min_new_tokens`` -> ``min_tokens``, ``sampler`` -> ``engine.options.sampler``)."""
    from engine.serve.openai.bodies import CompletionRequest
    from engine.serve.shared.fields import FieldTable

    table = FieldTable.of(CompletionRequest)
    body: dict[str, Any] = {"model": model, "prompt": [list(p) for p in prompts], "return_token_ids": True,
                            "return_tokens_as_token_ids": True, "temperature": 0.0}
    for group, values in (("generation", call.options), ("stop", call.stop or {})):
        for key, value in values.items():
            *parents, leaf = table.client_field(f"{group}.{key}").split(".")
            node = body
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return body


def row_of(choice: Mapping[str, Any]) -> Any:
    """A ``/v1/completions`` choice as a result row (ids, text, finish reason, logprobs by token id)."""
    from types import SimpleNamespace

    tops = (choice.get("logprobs") or {}).get("top_logprobs")
    logprobs = None if tops is None else tuple({int(k.removeprefix("token_id:")): v for k, v in step.items()}
                                               for step in tops)
    return SimpleNamespace(token_ids=tuple(choice["token_ids"]), text=choice["text"],
                           finish_reason=choice["finish_reason"], logprobs=logprobs)


@pytest.mark.parametrize("name", FIELDS)
def test_every_server_honours_the_option_as_hf_does_or_refuses_it(name, backend_names, probe, pool):
    """The same through each backend's server: ``POST /v1/completions`` with the field under its wire name answers
    HF's in-process rows, or a 400 naming the field as the client sent it."""
    import httpx

    from engine.serve.openai.bodies import CompletionRequest
    from engine.serve.shared.fields import FieldTable

    cases = cases_of(CASES[name](probe))
    if pool.options.dtype != "float32":
        pytest.skip("the rows are compared exactly, float32's promise")
    hf = pool.reference("hf", pool.options.model)
    prompts = [r.prompt_token_ids for r in probe.short]
    wire = FieldTable.of(CompletionRequest).client_field(name)
    failures = []
    for case in cases:
        calls = [("changed", case.changed)] + ([("base", case.base)] if case.comparable_base and not case.refused
                                              else [])
        want = {label: run(hf, case.base if case.same_as_base else call) for label, call in calls if not case.refused}
        for b in backend_names:
            server = pool.text_server(b)
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            for label, call in calls:
                reply = httpx.post(f"{server.url}/v1/completions", json=body_of(call, prompts, model), timeout=300)
                if case.refused:
                    assert reply.status_code == 400 and reply.json()["error"]["param"] == wire, (
                        f"{b}: {wire}={call.options.get(name.split('.', 1)[1])!r} answered {reply.status_code} "
                        f"{reply.text[:300]}, not a 400 naming {wire}")
                    continue
                assert reply.status_code == 200, f"{b} {label} {name}: {reply.status_code} {reply.text[:500]}"
                got = [row_of(c) for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]
                failures += same_rows(want[label], got, what=f"{b} server, {label} {wire} {call.options}", case=case,
                                      reference=hf, call=call, fields=("token_ids", "text", "finish_reason"))
    assert not failures, f"{name} ({wire}): a server does not do what HF does with it:\n" + "\n".join(failures)
