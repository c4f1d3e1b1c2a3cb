"""The served engine: one ``GenerationEngine`` behind HTTP, for learners that run rollouts in another process.

One folder per surface, each with its request bodies (``bodies.py``: every field marked with what it is to the
engine), its wire format both ways (no web framework) and its routes (``routes.py``): ``rollout/`` (swift's rollout
protocol and weight-sync routes), ``openai/`` (OpenAI's completions and vLLM's utility and LoRA routes),
``pattern_c/`` (``/chat``, min-length chat); ``shared/`` holds the HTTP pieces every surface uses. Beside them
:mod:`engine.serve.service` (the loaded engine), :mod:`engine.serve.app` (the app factory) and the start-up,
:mod:`engine.serve.launch` (``python -m engine.serve``: validate, activate the guard, load, bind, fail fast) and
:mod:`engine.serve.activation`. docs/layout.md names every file and what it holds. The learner side is
:mod:`engine.serve.rollout.client` (public name :mod:`engine.client`).

Nothing here imports torch, vLLM or a web framework on ``import engine.serve``.
"""
