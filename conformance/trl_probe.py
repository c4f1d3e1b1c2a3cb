"""TRL's own ``VLLMClient`` against a server, run in TRL 1.16's environment (a subprocess: the suite's process keeps
the TRL ms-swift needs). Reads one JSON job on stdin, prints one JSON answer: what TRL's client returned, unchanged.

    echo '{"url": "http://127.0.0.1:8000", "prompts": [[1, 2]], "n": 2, "sampling": {...}}' | \\
        PYTHONPATH=.nox/trl-1.16 python -m conformance.trl_probe

The job's ``sampling`` goes to ``VLLMClient.generate`` as TRL's trainer passes it (temperature, top_p, top_k, min_p,
repetition_penalty, max_tokens, logprobs; ``generation_kwargs`` for the seed). The answer holds TRL's version, the
server's world size and ``vllm_config`` as TRL read them, and ``generate``'s four lists.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import trl
    from trl.generation.vllm_client import VLLMClient

    job = json.load(sys.stdin)
    client = VLLMClient(base_url=job["url"], connection_timeout=60)
    out = {"trl": trl.__version__, "world_size": client.get_world_size(),
           "vllm_config": client.get_server_info()}
    out["generate"] = client.generate(job["prompts"], n=job["n"], **job["sampling"])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
