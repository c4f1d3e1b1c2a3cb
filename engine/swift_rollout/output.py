"""The ``/infer/`` item of a guarded ``swift rollout``: swift's ``RolloutOutput`` plus the ``coordexp`` envelope.

Swift's rollout workers hand their outputs to the server process through a pipe and FastAPI writes them out whole, so
a subclass with one more field is how the envelope reaches the wire without touching swift's routes. Swift's own
client parses items as ``RolloutOutput`` and drops the extra key; the same dict is also put in ``rollout_infos``,
which swift keeps (its trainer reads rollout infos).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from swift.infer_engine.protocol import RolloutOutput

from engine.swift_rollout import NAMESPACE


class GuardedRolloutOutput(RolloutOutput):
    """A ``RolloutOutput`` with the guard's per-row report under ``coordexp`` (:data:`engine.swift_rollout.NAMESPACE`).

    >>> GuardedRolloutOutput.model_fields["coordexp"].is_required()
    False
    """

    coordexp: dict[str, Any] = Field(default_factory=dict)


def enveloped(output: RolloutOutput, report: dict[str, Any]) -> GuardedRolloutOutput:
    """``output`` (swift's) with ``report`` under the namespace, at the top and in ``rollout_infos``."""
    fields = {name: getattr(output, name) for name in RolloutOutput.model_fields}
    fields["rollout_infos"] = {**(output.rollout_infos or {}), NAMESPACE: report}
    return GuardedRolloutOutput(**fields, **{NAMESPACE: report})
