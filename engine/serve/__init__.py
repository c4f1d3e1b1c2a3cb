"""The served engine: one ``GenerationEngine`` behind HTTP, for learners that run rollouts in another process.

One folder per surface, each with its request bodies (``bodies.py``: every field marked with what it is to the
engine), its wire format both ways (no web framework) and its routes (``routes.py``):

- ``rollout/`` -- swift's rollout protocol: ``/health``, ``/infer/`` (``infer.py``, with the additive envelope under
  ``serve.namespace``, ``coordexp`` by default: the seeds' name), ``/get_world_size/``, ``/get_engine_type/``,
  ``/metrics``; and swift's weight-sync routes (``weights.py``; the transfer itself: :mod:`engine.weights.sync`).
- ``openai/`` -- ``/v1/models``, ``/v1/chat/completions`` (``chat.py``), ``/v1/completions`` (``text.py``), what
  both share (``sampling.py``), and vLLM's utility routes ``/tokenize``, ``/detokenize``, ``/tokenizer_info``,
  ``/version`` (``tokenize.py``).
- ``pattern_c/`` -- ``/chat``, min-length chat ("Pattern C" is the seeds' name for it; ``chat.py``).

``shared/`` holds the HTTP pieces every surface uses: ``calls.py`` (the one call path: read within the body limit,
check, parse, limits, one model check, refuse by the client's field names; then answer whole or streamed, cancel on
disconnect, count), ``errors.py`` (OpenAI's error object and the one error-to-status table), ``fields.py`` (the
field markers and the tables built from them), ``bodies.py`` (checking a body against its model, ``/openapi.json``),
``formats.py`` (what the wire formats share: stop, messages, logprobs, usage), ``limits.py``, ``auth.py`` (the API
key), ``access.py`` (access log, request ids), ``metrics.py`` (Prometheus text).
Beside them: :mod:`engine.serve.service` (the loaded engine and what ``/health`` reports), :mod:`engine.serve.app`
(the app factory). Start-up: :mod:`engine.serve.launch` (``python -m engine.serve``: validate, activate the guard,
load, bind, fail fast) and :mod:`engine.serve.activation` (where the ``repeat_terminate`` subtree comes from). The
learner side is :mod:`engine.serve.rollout.client` (public name :mod:`engine.client`).

Nothing here imports torch, vLLM or a web framework on ``import engine.serve``.
"""
