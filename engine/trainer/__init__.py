"""The trainer's maths on what rollouts report, in one place: ``metrics.py`` (the rollout audit payload from the
envelope flags, and its aggregation across ranks), ``mismatch.py`` (rollout vs trainer logprobs), ``correction.py``
(rollout correction as ms-swift's GRPO trainer computes it). Pure Python and numpy: no backend is imported."""
