"""The trainer's half of vLLM's weight-transfer routes by its first name; the code lives in
:mod:`engine.weights.transfer` (issue 75 gathered every way weights arrive in ``engine/weights/``).

>>> from engine.weight_transfer import WeightTransferClient
>>> WeightTransferClient.__module__
'engine.weights.transfer'
"""

from engine.weights.transfer import WeightTransferClient

__all__ = ["WeightTransferClient"]
