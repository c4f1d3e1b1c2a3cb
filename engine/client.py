"""The learner side of the served engine, by its public name: ``RolloutClient``, ``AsyncRolloutClient``,
``launch_server`` (and ``ServerProcess``), ``check_activation``, ``RolloutServerError``.

The code lives beside what it calls, in :mod:`engine.serve.rollout.client` (the ``/infer/`` wire format it reads, the
activation and API-key settings it passes); import it from here.
"""

from engine.serve.rollout.client import (
    AsyncRolloutClient,
    RolloutClient,
    RolloutServerError,
    ServerProcess,
    check_activation,
    launch_server,
)

__all__ = ["AsyncRolloutClient", "RolloutClient", "RolloutServerError", "ServerProcess", "check_activation",
           "launch_server"]
