"""Backend names to lazy ``module:Class`` entries: the single source of truth for which backends exist."""

REGISTRY: dict[str, str] = {
    "hf": "engine.backends.hf.backend:HfBackend",
    "vllm": "engine.backends.vllm.backend:VllmBackend",
    "llamacpp": "engine.backends.llamacpp.backend:LlamaCppBackend",
}
