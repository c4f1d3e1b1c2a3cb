"""The vLLM backend: ``backend.py`` (``VllmBackend`` over ``vllm.LLM``; host facts such as ``has_cuda`` are in
:mod:`engine.backends.host`), ``async_backend.py`` (``AsyncLLM``, for servers), ``rules.py`` (row rules' per-request
arguments and rows) with one logits processor per model runner (``v1_rules.py``, ``v2_rules.py``), ``runner.py``
(which runner vLLM starts), ``events.py`` (rule events from the workers), ``memory.py`` (engines sharing a card).

Nothing here imports vllm until a backend is built."""
