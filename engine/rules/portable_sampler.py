"""The portable sampler: a counter-based Gumbel-max draw, written once, the same on every backend.

A sampled token is the argmax, over the processed distribution (penalty, temperature, min-p, top-k, top-p: the
shared order of :mod:`engine.rules.processing`), of ``logit + gumbel(u)``, where the uniform ``u`` of token ``t`` at
position ``pos`` of a row seeded ``seed`` is a murmur3 hash of ``(seed, pos, t)``. The draw depends on nothing else:
not the batch, not its order, not the backend's random stream. Two backends that compute the same processed
distribution draw the same token; where their float32 logits differ in the last bits, only a near-tie (two noisy
scores closer than that difference) can break the other way, and :func:`draw` reports the margin so a check can tell.

The arithmetic is vLLM's Model Runner V2 (``vllm/v1/worker/gpu/sample/gumbel.py``, the GPU runner's sampler):

- the hash: murmur3's 32-bit mix of four words, the seed's low and high halves, the position's low half and the token
  id, from ``h = domain`` (0; the fp64 variant's second half uses 0x9E3779B9), finalised with ``fmix32(h ^ 16)``;
- the position: the absolute position of the last input token, i.e. ``prompt_len - 1 + generated`` (vLLM's
  ``positions[logits_indices]``);
- float32 (the default): ``u = hi16 * 2**-16 + (lo16 + 0.5) * 2**-32`` and noise ``-log(-log(1 - u))`` with
  ``log(1 - u)`` from a degree-8 series below 0.25 (the winning tail keeps full resolution);
- float64 (``fp64=True``, vLLM's ``use_fp64_gumbel``): 53 bits from two hashes, ``u = (r53 + 0.5) * 2**-53`` and noise
  ``-log(-log(u))``.

The seed is the row's own seed (:func:`engine.rules.seeding.row_seed` of the call's seed and the row's index), so a
GRPO group of identical prompts draws distinct rows. Only the few tokens that can still win get their noise computed
(:func:`draw`: every token's hash is compared with a bound from its logit), exactly: the result is the argmax over the
whole vocabulary (``tests/test_portable_sampler.py`` checks it on flat, peaked and masked rows).

>>> import numpy as np
>>> logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
>>> [draw(logits, seed=7, pos=p).token for p in range(8)]  # one row, eight positions
[0, 1, 1, 0, 0, 0, 2, 2]
>>> draw(logits, seed=7, pos=3) == draw(logits.copy(), seed=7, pos=3)  # nothing but (seed, pos, token) decides
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_M32 = 0xFFFFFFFF
_C1, _C2, _MIX_ADD = 0xCC9E2D51, 0x1B873593, 0xE6546B64
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
FP64_DOMAIN = 0x9E3779B9
"""The domain of the second hash of the float64 uniform (vLLM's constant)."""


def _rotl_int(value: int, shift: int) -> int:
    return ((value << shift) | (value >> (32 - shift))) & _M32


def _mix_int(h: int, key: int) -> int:
    key = _rotl_int((key * _C1) & _M32, 15)
    key = (key * _C2) & _M32
    h = _rotl_int(h ^ key, 13)
    return (h * 5 + _MIX_ADD) & _M32


def _prefix(seed: int, pos: int, domain: int) -> int:
    """The hash state after the words that are the same for every token of a row's step (Python ints)."""
    h = _mix_int(domain & _M32, seed & _M32)
    h = _mix_int(h, (seed >> 32) & _M32)
    return _mix_int(h, pos & _M32)


def _token_keys(tokens: Any) -> Any:
    """The token word's key half of the mix (``rotl15(t * c1) * c2``), as uint32: independent of seed and position."""
    import numpy as np

    t = np.asarray(tokens, dtype=np.uint32)
    key = t * np.uint32(_C1)
    key = (key << np.uint32(15)) | (key >> np.uint32(17))
    return key * np.uint32(_C2)


_ALL_KEYS: dict[int, Any] = {}
"""The key half of every id of a vocabulary, by its size (one array per vocabulary: computed once)."""


def _keys_of_all(size: int) -> Any:
    import numpy as np

    if size not in _ALL_KEYS:
        _ALL_KEYS[size] = _token_keys(np.arange(size))
    return _ALL_KEYS[size]


def _finish(seed: int, pos: int, keys: Any, domain: int) -> Any:
    """The rest of murmur3 once the token words' key halves are known."""
    import numpy as np

    h = np.uint32(_prefix(seed, pos, domain)) ^ keys
    h = (h << np.uint32(13)) | (h >> np.uint32(19))
    h = h * np.uint32(5) + np.uint32(_MIX_ADD)
    h ^= np.uint32(16)  # the key's length in bytes, murmur3's finalisation
    h ^= h >> np.uint32(16)
    h *= np.uint32(_F1)
    h ^= h >> np.uint32(13)
    h *= np.uint32(_F2)
    return h ^ (h >> np.uint32(16))


def hash32(seed: int, pos: int, tokens: Any, domain: int = 0) -> Any:
    """murmur3 of ``(seed, pos, token)`` for each of ``tokens``, as uint32 (vLLM's ``murmur3_hash32``).

    >>> import numpy as np
    >>> [int(h) for h in hash32(0, 0, np.arange(3))]
    [2167721464, 10027521, 2423355346]
    >>> int(hash32(2**40 + 5, 9, [4])[0]) != int(hash32(5, 9, [4])[0])  # the seed's high half counts
    True
    """
    return _finish(seed, pos, _token_keys(tokens), domain)


def uniform32(seed: int, pos: int, tokens: Any) -> Any:
    """vLLM's float32 uniform in (0, 1): both 16-bit halves convert exactly, the sum rounds once.

    >>> import numpy as np
    >>> u = uniform32(3, 4, np.arange(1000))
    >>> str(u.dtype), bool((u > 0).all() and (u <= 1).all())
    ('float32', True)
    """
    import numpy as np

    r = hash32(seed, pos, tokens)
    hi = (r >> np.uint32(16)).astype(np.float32)
    lo = (r & np.uint32(0xFFFF)).astype(np.float32)
    return hi * np.float32(2.0**-16) + (lo + np.float32(0.5)) * np.float32(2.0**-32)


def uniform64(seed: int, pos: int, tokens: Any) -> Any:
    """vLLM's float64 uniform in (0, 1): 53 bits from two hashes (the second in :data:`FP64_DOMAIN`)."""
    import numpy as np

    lo = hash32(seed, pos, tokens).astype(np.uint64)
    hi = hash32(seed, pos, tokens, FP64_DOMAIN).astype(np.uint64)
    r53 = ((hi << np.uint64(32)) | lo) >> np.uint64(11)
    u = (r53.astype(np.float64) + 0.5) * 2.0**-53
    return np.where(u == 1.0, u - 2.0**-53, u)


def _log1p_neg(value: Any) -> Any:
    """``log(1 - value)`` in float32 as vLLM writes it: a degree-8 series below 0.25, the direct form above."""
    import numpy as np

    v = value.astype(np.float32)
    poly = np.full_like(v, np.float32(1.0 / 8.0))
    for k in (7, 6, 5, 4, 3, 2, 1):
        poly = np.float32(1.0 / k) + v * poly
    series = -v * poly
    with np.errstate(divide="ignore"):
        direct = np.log(np.maximum(np.float32(1.0) - v, np.float32(5.960464477539063e-08)))
    return np.where(v < np.float32(0.25), series, direct).astype(np.float32)


def gumbel_noise(seed: int, pos: int, tokens: Any, *, fp64: bool = False) -> Any:
    """The Gumbel noise of each of ``tokens`` at ``(seed, pos)``: float32, or float64 with ``fp64``."""
    import numpy as np

    if fp64:
        return -np.log(-np.log(uniform64(seed, pos, tokens)))
    return -np.log(-_log1p_neg(uniform32(seed, pos, tokens)))


def _noise_range(fp64: bool) -> tuple[float, float]:
    """The smallest and largest noise the draw can add (from the extreme uniforms each variant can produce)."""
    import numpy as np

    if fp64:
        extremes = np.array([0.5 * 2.0**-53, 1.0 - 2.0**-53])
        noise = -np.log(-np.log(extremes))
    else:
        extremes = np.array([0.5 * 2.0**-32, 1.0], dtype=np.float32)
        noise = -np.log(-_log1p_neg(extremes))
    return float(noise.min()), float(noise.max())


NOISE_RANGE = {False: (-2.8116, 22.8739), True: (-3.6225, 36.7369)}
"""(smallest, largest) noise per variant (float32: False), rounded outward; ``tests/test_portable_sampler.py``
recomputes them. A token whose logit is more than ``largest - smallest`` below the best cannot win."""
MARGIN_WINDOW = 1.0
"""How far below the winner :func:`draw` looks for the runner-up: a margin at least this wide is reported as this."""
_SLACK = 1e-3


@dataclass(frozen=True)
class Draw:
    """One row's draw: the token, the winning noisy score, and the margin to the runner-up (exact below
    :data:`MARGIN_WINDOW`, that window when at least as wide; inf: no other token could be drawn)."""

    token: int
    score: float
    margin: float


def draw(logits: Any, *, seed: int, pos: int, fp64: bool = False) -> Draw:
    """The portable draw of one row of processed logits (numpy or CPU torch, 1-D; -inf outside the kept support).

    Exact without computing every token's noise: the likeliest token's noisy score ``s`` is computed first; a token
    can come within :data:`MARGIN_WINDOW` of the winner only if its logit plus its noise reaches ``s - window``, and
    the noise is at most ``-log(u)`` (float32: ``-log(-log(1 - u)) <= -log(u)``; float64: ``-log(-log u) <=
    -log(1 - u)``), so one comparison of each token's uniform with ``exp(logit - s + window)`` leaves the few whose
    noise must be computed.

    >>> import numpy as np
    >>> draw(np.array([0.0, -np.inf, 5.0], dtype=np.float32), seed=1, pos=0).token  # a masked token never wins
    2
    """
    import numpy as np

    row = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
    dtype = np.float64 if fp64 else np.float32
    row = row.astype(dtype, copy=False)
    likeliest = int(np.argmax(row))
    anchor = float(row[likeliest] + gumbel_noise(seed, pos, [likeliest], fp64=fp64)[0])
    floor = anchor - MARGIN_WINDOW
    high = NOISE_RANGE[fp64][1]
    reach = row >= floor - high - _SLACK  # the rest cannot reach the floor with the largest noise
    if 2 * int(reach.sum()) > row.size:  # most can: every token's hash is cheaper than a gather
        tokens, keys = np.arange(row.size), _keys_of_all(row.size)
    else:
        tokens = np.flatnonzero(reach)
        keys = _token_keys(tokens)
    with np.errstate(over="ignore"):
        limit = np.exp((row[tokens] - np.float32(floor - _SLACK)).astype(np.float32))
    if fp64:  # 1 - u, the side of the uniform that gives large noise there, from u's high 32 bits: (1 - u) * 2**32
        # is at least 2**32 - hi - 1, and float32 moves hi by at most 256, so 512 less never leaves a token out
        r = _finish(seed, pos, keys, FP64_DOMAIN).astype(np.float32)
        passed = (np.float32(2.0**32) - r) - np.float32(512) <= limit * np.float32(2.0**32)
    else:  # u = (r + 0.5) * 2**-32 (float32 rounds it by less than the slack)
        r = _finish(seed, pos, keys, 0).astype(np.float32)
        passed = r <= limit * np.float32(2.0**32)
    candidates = tokens[passed]
    candidates = np.union1d(candidates, [likeliest])
    scores = row[candidates] + gumbel_noise(seed, pos, candidates, fp64=fp64).astype(dtype)
    first = int(np.argmax(scores))  # the first of equal scores, as vLLM's reduction keeps
    top = float(scores[first])
    scores[first] = -np.inf
    runner_up = float(scores.max()) if scores.size > 1 else -np.inf
    finite_others = int(np.isfinite(row).sum()) > 1
    margin = min(top - runner_up, MARGIN_WINDOW) if np.isfinite(runner_up) else (
        MARGIN_WINDOW if finite_others else float("inf"))
    return Draw(int(candidates[first]), top, margin)


def draw_rows(logits: Any, seeds: list[int], positions: list[int], *, fp64: bool = False) -> list[Draw]:
    """:func:`draw` for each row of a (batch, vocab) array or CPU tensor."""
    return [draw(logits[i], seed=seeds[i], pos=positions[i], fp64=fp64) for i in range(len(seeds))]
