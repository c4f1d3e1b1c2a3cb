"""The portable sampler's adapters on tiny synthetic logits: HF's last processor, llama.cpp's row step and vLLM's row
draw each take the shared rule's token, at the row's position, after the shared processing; vLLM's draw arguments
are refused by field at admission; the engine refuses the sampler with greedy decoding by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends.hf.sampling import RowSampler
from engine.backends.llamacpp.rules import LlamaCppRowStep
from engine.backends.vllm.portable import PortableDraw, portable_logprobs
from engine.backends.vllm.rules import build_row, parse_request_args, request_args
from engine.config import GenerationOptions
from engine.errors import ConfigError
from engine.rules.portable_sampler import draw
from engine.rules.processing import Processing, process

VOCAB = 300
PORTABLE = GenerationOptions(max_new_tokens=4, temperature=1.0, sampler="portable")
ARGS = {"sampler": "portable", "seed": 99, "pos0": 4, "temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.01,
        "repetition_penalty": 1.3, "logprobs": 3, "mode": "processed_logprobs"}


def logits(seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32) * 3)


def expected(row: torch.Tensor, seen: list[int], pos: int, banned: tuple[int, ...] = ()) -> int:
    source = row.clone()
    source[list(banned)] = float("-inf")
    processing = Processing(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.3)
    return draw(process(source, processing, seen)[0], seed=99, pos=pos).token


def test_vllm_row_draw_forces_the_shared_token_at_each_position_and_keeps_its_distribution():
    prompt, output = [1, 2, 3, 4, 5], []
    d = PortableDraw.of(ARGS, prompt=prompt, terminal=[0], min_new=2)
    for step in range(6):
        row = logits(step)
        want = expected(row, prompt + output, 4 + step, banned=(0,) if step < 2 else ())
        forced = row.clone()
        d.step(forced, output)
        assert torch.isfinite(forced).sum() == 1 and int(forced.argmax()) == want
        output.append(want)
    recorded = portable_logprobs(d.events())
    assert len(recorded) == 6 and all(tok in step for tok, step in zip(output, recorded, strict=True))
    assert all(v < 0 for step in recorded for v in step.values())  # the distribution, not the forced row's 0


def test_hf_last_processor_draws_the_shared_token_per_row_whatever_the_batch():
    rows = torch.stack([logits(10), logits(11), logits(12)])
    sampler = RowSampler([5, 6, 7], Processing.of(PORTABLE), sampler=PORTABLE.sampler, positions=[3, 8, 2])
    chosen = sampler(torch.zeros(3, 9, dtype=torch.long), rows.clone()).argmax(dim=-1).tolist()
    alone = RowSampler([6], Processing.of(PORTABLE), sampler=PORTABLE.sampler, positions=[8])
    assert chosen[1] == int(alone(torch.zeros(1, 9, dtype=torch.long), rows[1:2].clone()).argmax())
    assert chosen == [draw(rows[i], seed=s, pos=p).token for i, (s, p) in enumerate([(5, 3), (6, 8), (7, 2)])]
    second = sampler(torch.zeros(3, 10, dtype=torch.long), rows.clone()).argmax(dim=-1).tolist()  # next position
    assert second == [draw(rows[i], seed=s, pos=p + 1).token for i, (s, p) in enumerate([(5, 3), (6, 8), (7, 2)])]


def test_llamacpp_row_step_draws_the_shared_token():
    step = LlamaCppRowStep(prompt_len=5, terminal_ids=[0], rules=None, eos_id=0, seed=42,
                           options=GenerationOptions(max_new_tokens=4, temperature=1.0, sampler="portable"))
    row = logits(3).numpy().copy()
    want = draw(torch.from_numpy(row.copy()), seed=42, pos=4).token
    out = step(np.array([1, 2, 3, 4, 5]), row)
    assert np.isfinite(out).sum() == 1 and int(np.argmax(out)) == want


@pytest.mark.parametrize(("change", "field"), [({"seed": "9"}, "seed"), ({"sampler": "gumbel"}, "sampler"),
                                               ({"top_k": None}, "top_k")])
def test_vllm_admission_refuses_bad_draw_arguments_by_field(change, field):
    args = request_args([], key="k", eos_id=0, terminal_ids=[0], draw={**ARGS, **change})
    with pytest.raises(ValueError) as info:
        parse_request_args(args)
    assert "extra_args.engine_rules.draw" in str(info.value) and field in str(info.value)


def test_a_row_with_only_a_draw_builds_and_reports_its_logprobs():
    args = parse_request_args(request_args([], key="k1", eos_id=0, terminal_ids=[0], draw=ARGS))
    row = build_row(args, decode=None, track=False)
    row.take_draw(args, [1, 2, 3])
    row.draw.step(logits(0), [])
    assert "portable_logprobs" in row.events()


def test_the_sampler_option_is_checked_by_name():
    assert GenerationOptions(temperature=1.0, sampler="portable_fp64").sampler == "portable_fp64"
    with pytest.raises(ConfigError) as info:
        GenerationOptions(sampler="portable")  # greedy: it would change nothing
    assert info.value.field == "generation.sampler"
    with pytest.raises(ConfigError) as info:
        GenerationOptions(temperature=1.0, sampler="mrv2")
    assert info.value.field == "generation.sampler" and "portable" in str(info.value)
