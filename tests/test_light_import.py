"""``import engine`` stays light: no torch, transformers or vllm until a backend loads."""

from __future__ import annotations

import subprocess
import sys


def test_import_engine_pulls_no_heavy_module():
    code = ("import sys, engine, engine.rules.stop, engine.backends, engine.report.__main__; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'pandas', 'matplotlib', 'engine.report.writer')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_backend_lists_the_registry():
    from engine.backends import backend_class
    from engine.errors import ConfigError

    try:
        backend_class("vlm")
    except ConfigError as err:
        assert "did you mean 'vllm'" in str(err) and "hf" in str(err)
    else:
        raise AssertionError("an unknown backend must raise ConfigError")
