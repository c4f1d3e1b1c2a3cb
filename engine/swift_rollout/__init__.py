"""The engine's repeat guard inside ms-swift's own rollout server (``swift rollout``), without editing swift or vLLM.

Two ways in, one effect (:func:`engine.swift_rollout.attach.install`):

- ``swift rollout --external_plugins <PLUGIN_FILE> ...`` (``python -m engine.swift_rollout plugin`` prints the path);
- where ``--external_plugins`` is unavailable: ``PYTHONPATH=<SITE_DIR>`` (``python -m engine.swift_rollout site``),
  whose ``sitecustomize`` attaches the guard when swift imports its GRPO vLLM engine.

Both read the guard from the server's environment, the seeds' variables or the engine's own (one kind only, as
``python -m engine.serve`` takes them, :mod:`engine.serve.activation`)::

    COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION=1 \\
    COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON='{"enabled": true, "ngram_size": 5, "ngram_repeats": 4}' \\
    swift rollout --model M --external_plugins "$(python -m engine.swift_rollout plugin)"

What it does, in swift's rollout worker process (:mod:`.attach`): validates the subtree before anything is served
(a bad one stops ``swift rollout`` with the field, the value and the fix); registers the engine's row-rule
processor for the model runner vLLM will use (V1 or V2, vLLM's own decision) and a worker extension that keeps
swift's weight sync and adds the rule events; gives every request its rules (per-row EOS, no batch abort); and
returns every ``/infer/`` item as ``{"response": ..., "coordexp": {"repeat_terminate_triggered": 0|1, ...}}``
(additive: swift's clients ignore the key; the same dict also goes to ``rollout_infos["coordexp"]``, which swift's
trainer keeps). With ``..._INJECTION=0`` the envelope says 0 and no rule runs.

>>> from engine.swift_rollout import PLUGIN_FILE, SITE_DIR
>>> PLUGIN_FILE.name, (SITE_DIR / "sitecustomize.py").is_file()
('plugin.py', True)
"""

from pathlib import Path

PLUGIN_FILE = Path(__file__).resolve().parent / "plugin.py"
"""The file to give ``swift rollout --external_plugins``."""
SITE_DIR = Path(__file__).resolve().parent / "site"
"""The folder to put on ``PYTHONPATH`` where ``--external_plugins`` is unavailable (the engine's start-up hooks)."""
NAMESPACE = "coordexp"
"""The envelope key of every ``/infer/`` item: the seeds' name, ``serve.namespace``'s default on the engine's server."""
WORKER_EXTENSION = "engine.swift_rollout.worker.GuardedWorker"
"""The ``worker_extension_cls`` a guarded engine starts with (:mod:`engine.swift_rollout.worker`)."""
WORKER_BASE_VARIABLE = "ENGINE_SWIFT_WORKER_EXTENSION"
"""Where the worker extension swift configured is named for :mod:`engine.swift_rollout.worker` (set before vLLM starts;
the worker module reads it when vLLM imports it, so nothing imports that module earlier)."""
