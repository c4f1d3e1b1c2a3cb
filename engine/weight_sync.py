"""The learner's half of swift's weight-sync routes by its first name; the code lives in :mod:`engine.weights.sync`
(issue 75 gathered every way weights arrive in ``engine/weights/``).

>>> from engine.weight_sync import WeightSyncClient
>>> WeightSyncClient.__module__
'engine.weights.sync'
"""

from engine.weights.sync import LearnerClient, WeightSyncClient

__all__ = ["LearnerClient", "WeightSyncClient"]
