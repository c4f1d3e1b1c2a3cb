"""The seeded-sampling contract, the same on every backend: each row draws from its own generator.

A call's ``seed`` does not seed one stream for the whole batch (HF ``generate`` draws one ``torch.multinomial``
stream for every row; vLLM and llama.cpp seed every request with the same number). Row ``i`` of a call seeded
with ``s`` samples with its own generator seeded by ``row_seed(s, i)``. So:

- a group of identical prompts (a GRPO group) comes back as distinct samples, reproducibly;
- a row's sample depends only on (its prompt, the call seed, its index), never on the other rows' content;
- a batcher may merge seeded calls: each row carries its seed (``Prompt.seed``), not its batch position.

Seeds stay per backend: the same row seed gives a different sample on HF, vLLM and llama.cpp (their RNGs differ).
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def row_seed(seed: int, index: int) -> int:
    """The generator seed of row ``index`` of a call seeded with ``seed``: splitmix64 of (seed, index), in
    [0, 2**63) like a call seed.

    >>> row_seed(0, 0) == row_seed(0, 0), row_seed(0, 0) != row_seed(0, 1), row_seed(0, 1) != row_seed(1, 1)
    (True, True, True)
    >>> 0 <= row_seed(2**63 - 1, 10**6) < 2**63
    True
    """
    z = (seed + (index + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def row_seeds(seed: int | None, rows: int) -> list[int | None]:
    """``row_seed(seed, i)`` for each of ``rows`` rows; all None for an unseeded call.

    >>> row_seeds(None, 2)
    [None, None]
    >>> row_seeds(7, 2) == [row_seed(7, 0), row_seed(7, 1)]
    True
    """
    return [None if seed is None else row_seed(seed, i) for i in range(rows)]
