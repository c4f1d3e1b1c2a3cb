"""Repository-wide pytest settings."""

import importlib.util

from engine.backends.host import name_mkl_branch

name_mkl_branch()  # before anything imports torch (every session of the repository: tests, conformance, benchmarks)

# Start-up hooks for subprocesses; importing one in the test process would activate the compat shim.
collect_ignore = ["engine/compat/site", "engine/swift_rollout/site", "conformance/kit/isa_site"]
# The ms-swift plugin file attaches the guard when imported (that is its job, inside ``swift rollout``).
collect_ignore += ["engine/swift_rollout/plugin.py"]
if importlib.util.find_spec("vllm") is None:
    # The per-runner processor modules subclass vLLM's interfaces at import; without vLLM (``nox -s tests``)
    # doctest collection cannot import them. They hold no doctests; the conformance suite tests them.
    collect_ignore += ["engine/backends/vllm/v1_rules.py", "engine/backends/vllm/v2_rules.py",
                       "engine/vllm_plugin/processor.py"]
if importlib.util.find_spec("swift") is None:
    # The ms-swift plugin's output class subclasses swift's RolloutOutput at import (swift's workers pickle it);
    # ``nox -s tests`` installs no ms-swift. The conformance suite runs it inside ``swift rollout``.
    collect_ignore += ["engine/swift_rollout/output.py"]
