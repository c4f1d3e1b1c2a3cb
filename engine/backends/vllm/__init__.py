"""The vLLM backend: ``backend.py`` (``VllmBackend`` over ``vllm.LLM``, host helpers such as ``has_cuda`` and
``turn_torch_compile_off``), ``async_backend.py`` (``AsyncLLM``, for servers), ``rules.py`` (row rules' per-request
arguments and rows) with one logits processor per model runner (``v1_rules.py``, ``v2_rules.py``), ``runner.py``
(which runner vLLM starts), ``events.py`` (rule events from the workers), ``memory.py`` (engines sharing a card).

Nothing here imports vllm until a backend is built."""
