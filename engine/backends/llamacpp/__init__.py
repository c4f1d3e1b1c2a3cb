"""The llama.cpp backend: ``backend.py`` (``LlamaCppBackend`` over llama-cpp-python's ``Llama``) and ``rules.py``
(row rules as its per-token logits processor).

Nothing here imports llama_cpp until a backend is built."""
