"""Loaded by Python at start-up in subprocesses (vLLM's model-registry probe) when on PYTHONPATH.

It only re-applies :mod:`engine.compat.torchvision`, which does nothing where torchvision exists.
"""

try:
    from engine.compat import torchvision as _tv_compat

    _tv_compat.install()
except Exception as _err:  # a start-up hook must never break the interpreter; say why instead
    import sys

    print(f"engine.compat sitecustomize: not applied ({_err!r})", file=sys.stderr)
