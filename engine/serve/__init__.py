"""The served engine: one ``GenerationEngine`` behind HTTP, for learners that run rollouts in another process.

One pair of modules per surface, ``<surface>_routes.py`` (the FastAPI routes) and ``<surface>_wire.py`` (its wire
format both ways, no web framework):

- ``rollout_*`` -- swift's rollout protocol: ``/health``, ``/infer/`` (with the additive envelope under
  ``serve.namespace``, ``coordexp`` by default: the seeds' name), ``/get_world_size/``, ``/get_engine_type/``,
  ``/metrics``.
- ``openai_*`` -- ``/v1/models``, ``/v1/chat/completions`` (SSE streaming).
- ``pattern_c_*`` -- ``/chat``, min-length chat ("Pattern C" is the seeds' name for it).
- ``weights_routes`` -- swift's weight-sync routes (the transfer itself: :mod:`engine.weight_sync`).

Shared: :mod:`engine.serve.wire` (field tables used both ways, the ``engine`` extension field, logprobs, errors),
:mod:`engine.serve.answering` (one answering path: count, answer whole or stream, cancel on disconnect, refuse by
field), :mod:`engine.serve.auth` (the API key), :mod:`engine.serve.limits` (what one request may ask),
:mod:`engine.serve.service` (the loaded engine and what ``/health`` reports), :mod:`engine.serve.metrics`
(Prometheus text), :mod:`engine.serve.app` (the app factory).
Start-up: :mod:`engine.serve.launch` (``python -m engine.serve``: validate, activate the guard, load, bind, fail
fast) and :mod:`engine.serve.activation` (where the ``repeat_terminate`` subtree comes from). The learner side is
:mod:`engine.client`, beside this package.

Nothing here imports torch, vLLM or a web framework on ``import engine.serve``.
"""
