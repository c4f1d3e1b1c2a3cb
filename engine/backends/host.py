"""What the host offers, asked by backends, the weight-sync transport, the conformance suite and the benchmarks alike
(none of which should import a backend's module to learn it): whether torch sees a CUDA device, and turning
``torch.compile`` off for this process and every process it starts.

>>> isinstance(has_cuda(), bool)
True
"""

from __future__ import annotations

import os
import sys

TORCH_COMPILE_OFF = ("TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE")
"""torch's two switches for ``torch.compile``, both at ``1``: the first makes ``torch.compile(...)`` return the function
unchanged where it decorates one, the second (``torch._dynamo.config.disable``) makes compiled functions run
as plain torch ops when called."""


def name_mkl_branch() -> None:
    """Name MKL's code branch (``MKL_CBWR=AUTO``) before torch loads, unless the caller set one.

    Intel MKL (torch's CPU BLAS) takes its slowest sgemm path on AMD CPUs unless a branch is named: on the project's
    2-core AMD EPYC machines an fp32 SmolLM2 step in HF took 89 ms by default and 53 ms with AUTO (MKL picks the best
    branch the CPU supports; results stay deterministic). MKL reads it once, when torch loads; processes started
    from here inherit it."""
    if "torch" not in sys.modules:
        os.environ.setdefault("MKL_CBWR", "AUTO")


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (False without torch)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def turn_torch_compile_off() -> bool:
    """Run vLLM's compiled helpers as plain torch ops in this process and in every process it starts from now on
    (servers, engine cores inherit the environment). Returns False, and changes nothing, when the environment
    already sets either switch to something else (the user's own choice wins).

    vLLM compiles two sampler helpers with inductor even under ``enforce_eager`` (the logprob rank count, the
    top-k/top-p mask). On a CPU host, inductor builds C++ kernels for them at the first request that needs them,
    in every vLLM process: the first logprobs request of a fixture server took 33 s instead of 2 s. The test
    suite's CPU runs (eager engines, which compile nothing else) turn it off; the results are the same ops.
    """
    if any(os.environ.get(name, "1") != "1" for name in TORCH_COMPILE_OFF):
        return False
    os.environ.update(dict.fromkeys(TORCH_COMPILE_OFF, "1"))
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:  # read once at its import: already imported, so set it too
        config.disable = True
    return True
