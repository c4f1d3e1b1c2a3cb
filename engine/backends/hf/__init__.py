"""The Hugging Face transformers backend: ``backend.py`` (``HfBackend``), ``rules.py`` (row rules as a logits
processor), ``sampling.py`` (the per-row seeded draw), ``structured.py`` (the JSON Schema grammar mask).

Nothing here imports torch until a backend is built."""
