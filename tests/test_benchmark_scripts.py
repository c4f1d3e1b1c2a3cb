"""The measurement scripts beside the benchmarks (``benchmarks/server_start.py``,
``benchmarks/hf_continuous_batching.py``: run by hand, their figures in docs/conformance.md and docs/benchmarks.md)
stay runnable: each imports without torch or vLLM and answers ``--help`` with the options its docstring's command
line uses. A script nothing reaches would rot unseen; one that is no longer wanted is deleted together with the docs'
figures that cite it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py")
                 if not p.name.startswith(("test_", "_")) and 'if __name__ == "__main__"' in p.read_text())


def test_the_benchmark_folder_holds_the_scripts_the_docs_cite():
    docs = [doc.read_text() for doc in (ROOT / "docs").glob("*.md")]
    cited = {m for text in docs for m in re.findall(r"python -m benchmarks\.(\w+)", text)}
    assert {p.stem for p in SCRIPTS} == cited


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_measurement_script_answers_help_with_the_options_its_docstring_uses(script, capsys):
    module = importlib.import_module(f"benchmarks.{script.stem}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    documented = ast.get_docstring(ast.parse(script.read_text())) or ""
    used = set(re.findall(rf"python -m benchmarks\.{script.stem}((?: --?[\w-]+(?: [\w.]+)*)*)", documented)[0].split())
    assert {flag for flag in used if flag.startswith("--")} <= set(re.findall(r"--[\w-]+", shown))
