"""Backend names to lazy ``module:Class`` entries: the single source of truth for which backends exist."""

REGISTRY: dict[str, str] = {
    "hf": "engine.backends.hf:HfBackend",
    "vllm": "engine.backends.vllm:VllmBackend",
    "llamacpp": "engine.backends.llamacpp:LlamaCppBackend",
}
