"""Every backend's static facts, in one place: ``SPECS`` is the single source of truth for which backends exist and
what the rest of the project may know about one without importing it.

Pure data (no import beyond the standard library): the config validates names against it, the engine picks the
class it builds from it, plugins read the logits hook, servers and lm-eval read the settings they change, and the
conformance suite and the benchmarks read required modules and model formats from it. What a backend can do with a
given model once started lives in its ``Capabilities`` instead.

>>> SPECS["llamacpp"].logits_hook, SPECS["vllm"].modules
('llamacpp_logits_processor', ('vllm',))
>>> spec("vlm")
Traceback (most recent call last):
...
engine.errors.ConfigError: backend is not a registered backend, got 'vlm'. Fix: did you mean 'vllm'? \
available: hf, llamacpp, vllm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class BackendSpec:
    """What the project knows about one backend before it is imported.

    >>> BackendSpec(name="x", target="pkg.mod:X", modules=("pkg",), logits_hook="x_logits_processor").hooks
    frozenset({'x_logits_processor'})
    """

    name: str
    """The ``backend:`` value of a config, and the name of its settings section (``hf:``, ``vllm:``, ...)."""
    target: str
    """``module:Class`` of the backend, imported on first use."""
    modules: tuple[str, ...]
    """Top-level modules that must be importable for it to run (a missing one: the suite skips it, with the reason)."""
    logits_hook: str
    """The plugin hook through which it applies a row rule to each step's logits."""
    extra_hooks: tuple[str, ...] = ()
    """Hooks it offers beyond ``logits_hook`` (HF's stopping criteria)."""
    async_target: str | None = None
    """``module:Class`` built instead of ``target`` when its settings say ``async_engine: true``."""
    served_settings: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """What ``python -m engine.serve`` sets in its settings section (vLLM: ``async_engine``, so concurrent requests
    share continuous batching)."""
    child_process_settings: tuple[str, ...] = ()
    """Settings any of which, when true, put its engine core in a child process (reported by ``/health``)."""
    model_format: str = "hf"
    """What ``model.path`` holds for it: ``hf`` (a checkpoint folder) or ``gguf`` (a GGUF file or a folder holding
    one, with the HF tokenizer files)."""
    takes_attn_implementation: bool = False
    """Whether ``model.attn_implementation`` applies to it."""
    takes_device: bool = False
    """Whether ``model.device`` applies to it (the others pick their own device)."""
    serves_images: bool = False
    """Whether it can serve vision-language requests at all (per model: ``Capabilities.supports_vlm``)."""
    structured_outputs: bool = False
    """Whether it can constrain output to a JSON schema at all (per model: ``Capabilities.structured_outputs``)."""
    batch_size_setting: str | None = None
    """The settings key lm-eval's ``batch_size`` sets (None: lm-eval's batch size does not reach it)."""
    shares_card: bool = False
    """Whether each engine takes a fixed share of a CUDA card (vLLM's ``gpu_memory_utilization``)."""
    parallel_settings: tuple[str, ...] = ()
    """Settings whose product is its world size (the ranks a ``/infer/`` learner sees)."""
    logprobs_mode_at_load: bool = False
    """Whether ``model.logprobs_mode`` is fixed when the backend starts (vLLM's sampler takes it then); the others
    read it per call, so ``GenerationEngine.derive(model={"logprobs_mode": ...})`` serves another mode unloaded."""
    settings_section: str | None = None
    """The config section whose settings it is built with (None: the section named after it, built-ins only). A
    backend from another package names a built-in section it shares (``"hf"`` for a transformers-based one)."""

    @property
    def hooks(self) -> frozenset[str]:
        """Every hook it offers when everything works (checked before it starts)."""
        return frozenset((self.logits_hook, *self.extra_hooks))

    def target_for(self, settings: object) -> str:
        """The class to build for these settings: ``async_target`` when they ask for the async engine."""
        if self.async_target is not None and getattr(settings, "async_engine", False):
            return self.async_target
        return self.target

    def engine_core_in_child(self, settings: object) -> bool:
        """Whether these settings run its engine core in a child process."""
        return any(getattr(settings, name, False) for name in self.child_process_settings)


BUILT_IN: Mapping[str, BackendSpec] = MappingProxyType({
    "hf": BackendSpec(
        name="hf", target="engine.backends.hf.backend:HfBackend", modules=("torch", "transformers"),
        logits_hook="hf_logits_processor", extra_hooks=("hf_stopping_criteria",), takes_attn_implementation=True,
        takes_device=True, serves_images=True, structured_outputs=True, batch_size_setting="max_batch_size"),
    "vllm": BackendSpec(
        name="vllm", target="engine.backends.vllm.backend:VllmBackend", modules=("vllm",),
        logits_hook="vllm_logits_processor", async_target="engine.backends.vllm.async_backend:AsyncVllmBackend",
        logprobs_mode_at_load=True,
        served_settings=MappingProxyType({"async_engine": True}),
        child_process_settings=("async_engine", "multiprocessing"), serves_images=True, structured_outputs=True,
        shares_card=True,
        parallel_settings=("tensor_parallel_size", "data_parallel_size")),
    "llamacpp": BackendSpec(
        name="llamacpp", target="engine.backends.llamacpp.backend:LlamaCppBackend", modules=("llama_cpp", "torch"),
        logits_hook="llamacpp_logits_processor", model_format="gguf"),
})
"""The backends this package ships, by name."""

ENTRY_POINT_GROUP = "xbackend_engine.backends"
"""Where another package registers a backend: an entry point named after it whose object is its
:class:`BackendSpec` (``[project.entry-points."xbackend_engine.backends"] mine = "my_pkg.spec:SPEC"``, a module
that imports nothing heavy; the class itself is imported from ``target`` on first use)."""
PLUGIN_ERRORS: dict[str, str] = {}
"""Entry points of the group that could not be registered, by name, with why (``spec`` raises it by name)."""


def _from_entry_points() -> dict[str, BackendSpec]:
    """The backends other installed packages register (:data:`ENTRY_POINT_GROUP`); a broken one is kept out and
    its reason kept for :func:`spec`, so one bad package never breaks ``import engine``."""
    from importlib.metadata import entry_points

    found: dict[str, BackendSpec] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name} = {point.value!r} ({ENTRY_POINT_GROUP})"
        try:
            value = point.load()
        except Exception as err:  # a third party's import error: reported by name when the backend is asked for
            PLUGIN_ERRORS[point.name] = f"{where} failed to load: {type(err).__name__}: {err}"
            continue
        problem = plugin_problem(point.name, value)
        if problem:
            PLUGIN_ERRORS[point.name] = f"{where} {problem}"
        else:
            found[point.name] = value
    return found


def plugin_problem(name: str, value: object) -> str | None:
    """Why an entry point's object cannot join the registry under ``name`` (None: it can).

    >>> plugin_problem("hf", BUILT_IN["hf"])
    "names 'hf', a built-in backend (pick another name)"
    >>> plugin_problem("mine", BackendSpec(name="mine", target="m:M", modules=(), logits_hook="h",
    ...                                    settings_section="tgi"))
    "sets settings_section 'tgi', which is not a built-in section (one of: hf, vllm, llamacpp)"
    """
    if not isinstance(value, BackendSpec):
        return f"is a {type(value).__name__}, not an engine.backends.registry.BackendSpec"
    if name in BUILT_IN:
        return f"names {name!r}, a built-in backend (pick another name)"
    if value.name != name:
        return f"holds a spec named {value.name!r}; the entry point's name must be the spec's name"
    if value.settings_section not in BUILT_IN:
        return (f"sets settings_section {value.settings_section!r}, which is not a built-in section "
                f"(one of: {', '.join(BUILT_IN)})")
    return None


SPECS: Mapping[str, BackendSpec] = MappingProxyType({**BUILT_IN, **_from_entry_points()})
"""Backends, by name: the built-in ones, then those other packages register (:data:`ENTRY_POINT_GROUP`)."""

REGISTRY: Mapping[str, str] = MappingProxyType({name: s.target for name, s in SPECS.items()})
"""Backend name -> ``module:Class`` (a view of ``SPECS``)."""


def spec(name: str) -> BackendSpec:
    """The spec registered under ``name``; an unknown name is a ``ConfigError`` naming the close ones."""
    if name not in SPECS:
        from engine.errors import ConfigError, did_you_mean

        if name in PLUGIN_ERRORS:
            raise ConfigError("backend", name, f"is not registered: its {PLUGIN_ERRORS[name]}",
                              fix="fix or reinstall the package that registers it")
        raise ConfigError("backend", name, "is not a registered backend", fix=did_you_mean(name, SPECS))
    return SPECS[name]


def settings_section(name: str) -> str:
    """The config section a backend is built with: its own (built-ins) or the built-in one it shares."""
    return spec(name).settings_section or name
