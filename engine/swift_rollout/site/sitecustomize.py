"""The ms-swift rollout plugin's fallback where ``--external_plugins`` is unavailable: put this folder on
``PYTHONPATH`` (``python -m engine.swift_rollout site`` prints it) and start ``swift rollout`` as usual.

Python loads one ``sitecustomize`` per interpreter, so this one does both start-up jobs the engine has there:
the torchvision stand-in of :mod:`engine.compat.torchvision` (nothing where torchvision exists), and
:func:`engine.swift_rollout.hook.arm`, which attaches the guard when swift imports its GRPO vLLM engine (in swift's
main process and in each rollout worker, which inherit this ``PYTHONPATH``).
"""

import sys

try:
    from engine.compat import torchvision as _tv_compat

    _tv_compat.install()
except Exception as _err:  # a start-up hook must never break the interpreter; say why instead
    print(f"engine.swift_rollout sitecustomize: torchvision compat not applied ({_err!r})", file=sys.stderr)

try:
    from engine.swift_rollout import hook as _hook

    _hook.arm()
except Exception as _err:
    print(f"engine.swift_rollout sitecustomize: hook not armed ({_err!r})", file=sys.stderr)
