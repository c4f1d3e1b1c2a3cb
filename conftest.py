"""Repository-wide pytest settings."""

import importlib.util

# A start-up hook for subprocesses; importing it in the test process would activate the compat shim.
collect_ignore = ["engine/compat/site"]
if importlib.util.find_spec("vllm") is None:
    # The per-runner processor modules subclass vLLM's interfaces at import; without vLLM (``nox -s tests``)
    # doctest collection cannot import them. They hold no doctests; the conformance suite tests them.
    collect_ignore += ["engine/backends/vllm_v1_rules.py", "engine/backends/vllm_v2_rules.py"]
