"""Reproduce an AVX2-only host's CPU kernels on a machine with AVX-512 (and AMX), for a run that asks for it.

Machines of the project's kind differ in instruction set under the same label: some have AVX-512-BF16 and AMX,
some AVX2 and FMA only, and bfloat16 rounds differently on each. A run forced to AVX2 sets PyTorch's, oneDNN's and
MKL's own switches (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``).
vLLM's CPU build does not read them: it picks its kernel library (``vllm._C`` for AVX-512-BF16, ``_C_AVX512``,
``_C_AVX2``) and its attention ISA (``amx`` for bfloat16 where AMX exists) from ``torch.cpu``'s hardware probes.
So, when ``ATEN_CPU_CAPABILITY`` asks for AVX2 (or less), :func:`follow_aten_capability` makes those probes answer
what an AVX2-only host answers, before vLLM is imported in this process: the in-process engines then load
``_C_AVX2`` and vLLM's vector attention, as on that host. It also puts ``isa_site`` (and the repository root) first
on ``PYTHONPATH``, so every process the suite starts (servers, their vLLM engine cores) does the same at start-up:
a served twin compared with its in-process engine must not compare two machines' kernels. llama.cpp's native build
is compiled for the building machine (``-march=native``) and reads none of these switches.
"""

from __future__ import annotations

import os
from pathlib import Path

SITE = Path(__file__).resolve().parent / "isa_site"
"""The start-up hook that applies :func:`follow_aten_capability` in the processes the suite starts."""

PROBES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_amx_tile_supported",
          "_is_amx_fp16_supported")
"""``torch.cpu`` probes that answer False on an AVX2-only host."""
BELOW_AVX512 = ("default", "avx2")
"""``ATEN_CPU_CAPABILITY`` values that rule AVX-512 out."""


def forced_below_avx512() -> bool:
    """Whether this run asks PyTorch for AVX2 kernels or less (``ATEN_CPU_CAPABILITY``)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in BELOW_AVX512


def follow_aten_capability() -> list[str]:
    """When :func:`forced_below_avx512`, make ``torch.cpu``'s AVX-512 and AMX probes answer False in this process
    (vLLM then loads the kernels an AVX2-only host loads); returns the probes it changed, for the run's header."""
    if not forced_below_avx512():
        return []
    import torch.cpu

    changed = [name for name in PROBES if hasattr(torch.cpu, name)]
    for name in changed:
        setattr(torch.cpu, name, lambda: False)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [str(SITE), str(SITE.parents[2])]
    os.environ["PYTHONPATH"] = os.pathsep.join([*first, *(p for p in paths if p not in first)])
    return changed
