"""A backend from another package, as a third party writes one: its spec here (what the entry point names; nothing
heavy is imported), its class in ``backend.py`` (imported from ``target`` when an engine is built).

The distribution beside this folder (``xbackend_example-0.1.0.dist-info``) registers it in the group
``xbackend_engine.backends``; put this folder on ``PYTHONPATH`` and ``backend: example`` works everywhere a backend
name does: configs, ``python -m engine.serve``, and the conformance suite (``--engine-backends hf,example``).
"""

from engine.backends.registry import BackendSpec

SPEC = BackendSpec(
    name="example", target="xbackend_example.backend:ExampleBackend", modules=("torch", "transformers"),
    logits_hook="hf_logits_processor", extra_hooks=("hf_stopping_criteria",), takes_device=True,
    takes_attn_implementation=True, structured_outputs=True, batch_size_setting="max_batch_size",
    settings_section="hf")
