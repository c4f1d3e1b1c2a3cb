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


def async_grpo_lora(job: dict) -> dict:
    """TRL's async GRPO with a LoRA policy, step by step as its trainer and rollout worker run them: its client reads
    ``/server_info`` and TRL's own ``select_adapter_sync`` decides adapter-only sync for a PEFT model of the job's
    adapter (``max_staleness`` 0); the client loads the adapter as ``trl-policy-v1``; the worker's ``/v1/completions``
    body (token-id prompt, ``model`` the versioned name, ``return_token_ids``, ``logprobs: 0``; greedy here) is sent;
    the client unloads it. Answers the decision, the ids and logprobs, and the unloaded name's status."""
    from types import SimpleNamespace

    import requests
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncVLLMClient

    client = AsyncVLLMClient(job["url"])
    info = client.get_server_info()
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(job["base"], dtype=torch.float32),
                                       job["lora_path"])
    adapter_sync = select_adapter_sync(info, policy, SimpleNamespace(max_staleness=0))
    client.load_lora_adapter("trl-policy-v1", job.get("served_path", job["lora_path"]))  # the server's own files
    body = {"model": "trl-policy-v1", "prompt": job["prompt"], "max_tokens": job["max_tokens"], "temperature": 0.0,
            "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0,
            "seed": 7}
    answer = requests.post(f"{job['url']}/v1/completions", json=body, timeout=300).json()
    client.unload_lora_adapter("trl-policy-v1")
    after = requests.post(f"{job['url']}/v1/completions", json=body, timeout=300).status_code
    choice = answer["choices"][0]
    return {"adapter_sync": adapter_sync, "lora_config": info["lora_config"], "token_ids": choice["token_ids"],
            "token_logprobs": choice["logprobs"]["token_logprobs"], "model": answer["model"], "after_unload": after}


def main() -> None:
    import trl
    from trl.generation.vllm_client import VLLMClient

    job = json.load(sys.stdin)
    if job.get("mode") == "async_grpo_lora":
        json.dump({"trl": trl.__version__, **async_grpo_lora(job)}, sys.stdout)
        return
    client = VLLMClient(base_url=job["url"], connection_timeout=60)
    out = {"trl": trl.__version__, "world_size": client.get_world_size(),
           "vllm_config": client.get_server_info()}
    out["generate"] = client.generate(job["prompts"], n=job["n"], **job["sampling"])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
