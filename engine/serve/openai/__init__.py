"""OpenAI's surface and vLLM's utility routes (the map: :mod:`engine.serve`)."""
