"""The served engine: one ``GenerationEngine`` behind HTTP, for learners that run rollouts in another process.

- :mod:`engine.serve.launch` -- ``python -m engine.serve``: validate, activate the guard, load, bind (fail fast).
- :mod:`engine.serve.activation` -- where the ``repeat_terminate`` subtree comes from (config, env, learner YAML).
- :mod:`engine.serve.protocol` -- the ``/infer/`` wire format both ways (swift's rollout protocol + envelope).
- :mod:`engine.serve.rollout` -- ``/health``, ``/infer/``, ``/get_world_size/``, ``/get_engine_type/``, ``/metrics``.
- :mod:`engine.serve.openai` -- ``/v1/models``, ``/v1/chat/completions`` (SSE streaming); wire format in
  :mod:`engine.serve.openai_protocol`. :mod:`engine.serve.chat` -- Pattern C ``/chat``; wire format in
  :mod:`engine.serve.pattern_c`. What both share (answer, stream, count, cancel): :mod:`engine.serve.answering`.
- :mod:`engine.serve.app` -- the FastAPI app factory; :mod:`engine.serve.metrics` -- Prometheus text.
- :mod:`engine.client` (beside this package) -- the learner side.

Nothing here imports torch, vLLM or a web framework on ``import engine.serve``.
"""
