"""``swift rollout --external_plugins <this file>``: attach the engine's repeat guard (:mod:`engine.swift_rollout`).

swift imports this file in its main process (while parsing arguments, so a bad guard subtree stops the server before
it serves) and again in every rollout worker process, where the vLLM engine is built.
"""

from engine.swift_rollout.attach import install

install()
