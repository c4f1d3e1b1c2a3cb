"""The engine inside lm-evaluation-harness: ``--model engine``, with schema-constrained JSON answers.

``model.py`` (the lm-eval model), ``schema.py`` (JSON extraction, validation, answer counts; pure code),
``cache.py`` (the SQLite answer cache). Needs the ``lm-eval`` extra (``pip install 'xbackend-engine[lm-eval]'``).

lm-eval 0.4.13 finds models only in its own registry (it scans no entry points), so something must register
``engine`` there before a run: ``python -m engine.lm_eval run --model engine ...`` is lm-eval's own CLI with the
model registered; in Python, :func:`register` (or importing ``engine.lm_eval.model``) does it. The package also
declares the ``lm_eval.models`` entry point ``engine`` for harness versions that scan them.
"""

from __future__ import annotations

MODEL_NAME = "engine"
MODEL_TARGET = "engine.lm_eval.model:EngineLM"


def register() -> None:
    """Register ``engine`` in lm-eval's model registry (lazily: the model module loads on first use).

    >>> register()
    >>> from lm_eval.api.registry import get_model
    >>> get_model("engine").__name__
    'EngineLM'
    """
    import lm_eval.models  # noqa: F401  (lm-eval's own models first: an empty registry would skip them)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)
