"""Repository-wide pytest settings."""

import importlib.util
import os
import sys

# Intel MKL (torch's CPU BLAS) takes its slowest sgemm path on AMD CPUs unless a code branch is named: on this
# project's 2-core AMD EPYC machines an fp32 SmolLM2 step in HF took 89 ms by default and 53 ms with MKL_CBWR=AUTO
# (MKL picks the best branch the CPU supports; results stay deterministic). MKL reads it once, when torch loads,
# so it is set before anything imports torch; a value the caller set wins. Servers the suite launches inherit it.
if "torch" not in sys.modules:
    os.environ.setdefault("MKL_CBWR", "AUTO")

# Start-up hooks for subprocesses; importing one in the test process would activate the compat shim.
collect_ignore = ["engine/compat/site", "engine/swift_rollout/site", "conformance/isa_site"]
# The ms-swift plugin file attaches the guard when imported (that is its job, inside ``swift rollout``).
collect_ignore += ["engine/swift_rollout/plugin.py"]
if importlib.util.find_spec("vllm") is None:
    # The per-runner processor modules subclass vLLM's interfaces at import; without vLLM (``nox -s tests``)
    # doctest collection cannot import them. They hold no doctests; the conformance suite tests them.
    collect_ignore += ["engine/backends/vllm/v1_rules.py", "engine/backends/vllm/v2_rules.py"]
if importlib.util.find_spec("swift") is None:
    # The ms-swift plugin's output class subclasses swift's RolloutOutput at import (swift's workers pickle it);
    # ``nox -s tests`` installs no ms-swift. The conformance suite runs it inside ``swift rollout``.
    collect_ignore += ["engine/swift_rollout/output.py"]
