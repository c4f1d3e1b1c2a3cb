"""What the row rules cost per token per row, through the HF adapter, without a model.

For each rule and batch size, the adapter (``HfRowRules``) is stepped over a fixed real SmolLM2 token stream as
``generate`` would call it (ids so far, a full-vocabulary logits row per request, on the benchmark device),
twice per round, interleaved. The logits are the model's own next-token logits along the stream (8 positions;
a step's rows take different ones; a step's tensor comes back every 8 steps, EOS's column restored after each
step: a one-column write, timed in both variants alike):

* ``decode+rowwise`` (reference): the path before the fast text path and the vectorized id rules, text from
  ``tokenizer.decode`` per token (two calls), every rule fed per row in Python;
* ``table+vectorized`` (subject): the path the engine takes: text from the tokenizer's byte table, id-only
  repeat rules as array operations over the batch (from ``VECTOR_MIN_BATCH`` rows on; per row below it).

Rules: ``repeat_ids`` (consecutive + n-gram thresholds), ``repeat_keys`` (plus ``max_object_keys``: reads
text), ``min_length`` (EOS held back all along; until a row saw EOS on top of its unedited logits, each step
asks whether it is, and each step asks whether EOS is the only token left), ``json_boundary``. None fires on the
stream, so every step costs what watching costs. Recorded: ``us_per_token`` (per token per row) of each variant
and ``fast_over_reference``. Both variants must make identical edits (EOS's column of every step and the rows'
rule events).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import REPEAT_GUARD
from engine.rules.base import RuleSpec

BATCHES = (1, 64, 256)
REPEAT = "engine.rules.repeat:RepeatRule"
THRESHOLDS = {k: v for k, v in REPEAT_GUARD.items() if k != "enabled"}
RULES = {
    "repeat_ids": [RuleSpec(REPEAT, {"thresholds": THRESHOLDS})],
    "repeat_keys": [RuleSpec(REPEAT, {"thresholds": {**THRESHOLDS, "max_object_keys": 50}})],
    "min_length": [RuleSpec("engine.rules.min_length:MinLengthRule",
                            {"min_chars": 100_000, "max_chars": None, "punctuation_bias": 0.0,
                             "sentence_end_ids": []})],
    "json_boundary": [RuleSpec("engine.rules.json_boundary:JsonBoundaryRule")],
}
# A JSON string that stays open (the boundary never closes), prose with accents and emoji inside.
STREAM_TEXT = ('{"notes": "' + " ".join(
    f"Entry {i}: the café on street {i % 9} serves crème brûlée 🍮 and naïve jokes; visitors rate it {i % 5}/5."
    for i in range(60)))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rule_case" not in metafunc.fixturenames:
        return
    cases = [(rule, batch) for rule in RULES for batch in BATCHES]
    if metafunc.config.stash.get(SESSION_KEY, None) is None:
        cases = cases[:1]  # not opted in: one placeholder, skipped by the conftest
    metafunc.parametrize("rule_case", cases, ids=[f"{r}-b{b}" for r, b in cases])


def steps_for(bench: Any) -> int:
    return 64 if bench.size_name == "smoke" else 256


POSITIONS = 8
EOS = 2  # SmolLM2-Instruct's <|im_end|>


@functools.cache
def position_logits(model_path: str, prefix: tuple[int, ...]) -> Any:
    """The model's next-token logits after each of the last ``POSITIONS`` prefixes of ``prefix`` (one model load
    and forward per session)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([list(prefix)])).logits[0, -POSITIONS:].float()


def real_logits(model_path: str, stream: list[int], batch: int, device: str) -> list[Any]:
    """:func:`position_logits` as ``POSITIONS`` batch tensors (tensor k's row r: position ``(k + r) % POSITIONS``)."""
    rows = position_logits(model_path, tuple(stream[:16 + POSITIONS]))
    return [rows[[(k + r) % POSITIONS for r in range(batch)]].to(device).contiguous() for k in range(POSITIONS)]


def stepper(name: str, role: str, specs: list[RuleSpec], ids: Any, prompt_len: int, pool: list[Any], *,
            text: Any, vectorize: bool, last: dict[str, Any]) -> Variant:
    from engine.backends.hf.rules import HfRowRules

    batch, width = ids.shape
    fresh_eos = [scores[:, EOS].clone() for scores in pool]

    def run() -> int:
        proc = HfRowRules(specs, prompt_len=prompt_len, eos_id=EOS, terminal_ids=[EOS], decode=text,
                          vectorize=vectorize)
        columns = []
        for step, end in enumerate(range(prompt_len + 1, width + 1)):
            scores = pool[step % POSITIONS]
            proc(ids[:, :end], scores)  # bans EOS (min_length); no other rule fires on the stream
            columns.append(scores[:, EOS].clone())
            scores[:, EOS] = fresh_eos[step % POSITIONS]  # the next use sees the model's logits again
        last[name] = (columns, [proc.events(row) for row in range(batch)])
        return batch * (width - prompt_len)

    return Variant(name, role, run)


def test_rule_cost(bench, benchmark, rule_case) -> None:
    import torch
    from transformers import AutoTokenizer

    from engine.rules.min_length_bank import byte_counts
    from engine.rules.token_text import TokenBytes

    rule, batch = rule_case
    tokenizer = AutoTokenizer.from_pretrained(bench.model_path)
    stream = tokenizer.encode(STREAM_TEXT, add_special_tokens=False)
    steps, prompt_len = steps_for(bench), 4
    assert len(stream) >= steps + prompt_len + 7
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [stream[r % 7: r % 7 + prompt_len + steps] for r in range(batch)]  # rows differ a little
    ids = torch.tensor(rows, device=device)  # (batch, prompt + steps)
    table = TokenBytes.from_tokenizer(tokenizer)
    assert table is not None, "the benchmark measures the byte table; this tokenizer has none"
    decode = lambda seq: tokenizer.decode(list(seq), skip_special_tokens=True)  # noqa: E731
    pool = real_logits(bench.model_path, stream, batch, device)
    byte_counts(table)  # built once per tokenizer's table (a pass over the vocabulary), not per request: not timed
    last: dict[str, Any] = {}
    reference = stepper("decode+rowwise", "reference", RULES[rule], ids, prompt_len, pool, text=decode,
                        vectorize=False, last=last)
    subject = stepper("table+vectorized", "subject", RULES[rule], ids, prompt_len, pool, text=table,
                      vectorize=True, last=last)
    rounds = bench.measure(benchmark, f"rule_cost[{rule}-b{batch}]", [reference, subject], gated=False)
    (ref_columns, ref_events), (columns, events) = last[reference.name], last[subject.name]
    assert all(torch.equal(a, b) for a, b in zip(ref_columns, columns, strict=True)), "the paths edit differently"
    assert ref_events == events, "the paths' rule events differ"
    ratio = rounds.speed_ratio(subject.name, reference.name)
    bench.record({"benchmark": f"rule_cost[{rule}-b{batch}]", "group": "rule_cost", "backend": "hf",
                  "batch": batch, "prompt_len": "rule_stream", "prompt_tokens": batch * prompt_len,
                  "new_tokens": steps, "fixed_length": True, "guard_set": rule},
                 rounds, {"fast_over_reference": ratio,
                          "added_ms_per_step": rounds.median_wall(subject.name) / steps * 1e3}, benchmark)
    per_token = {name: rounds.median_wall(name) / (batch * steps) * 1e6 for name in (reference.name, subject.name)}
    bench.progress(f"rule_cost[{rule}-b{batch}] us/token/row: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                            per_token.items()))
