"""Backends from other packages: the registry reads the ``xbackend_engine.backends`` entry points.

Each case runs a fresh interpreter (the registry reads entry points once, at import) with an installed distribution
on ``PYTHONPATH``: the example backend in ``conformance/subjects/example_backend`` (a real ``.dist-info``), or a broken
one written here. The conformance suite runs the example beside HF (``conformance/test_third_party_backend.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "conformance" / "subjects" / "example_backend"


def run(code: str, *paths: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def dist(root: Path, name: str, entry: str) -> Path:
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[xbackend_engine.backends]\n{entry}\n")
    return root


def test_an_installed_backend_joins_the_registry_the_config_and_the_class_lookup():
    out = run("""
import json
from engine.backends import backend_class
from engine.backends.registry import SPECS, settings_section
from engine.config import BACKENDS, EngineConfig, HfConfig
cfg = EngineConfig.from_dict({"backend": "example", "model": "/m", "fallback_backend": "hf"})
cls = backend_class("example", HfConfig())
print(json.dumps({"backends": list(BACKENDS), "section": settings_section("example"), "backend": cfg.backend,
                  "class": f"{cls.__module__}.{cls.__name__}", "name": cls.name, "hooks": sorted(cls.declared_hooks)}))
""", EXAMPLE)
    assert out["backends"] == ["hf", "vllm", "llamacpp", "example"]
    assert out["section"] == "hf" and out["backend"] == "example"
    assert out["class"] == "xbackend_example.backend.ExampleBackend" and out["name"] == "example"
    assert out["hooks"] == ["hf_logits_processor", "hf_stopping_criteria"]


def test_a_broken_or_clashing_entry_point_is_refused_by_name_when_asked_for(tmp_path):
    broken = dist(tmp_path / "a", "broken-backend", "broken = no_such_module_here:SPEC")
    clash = dist(tmp_path / "b", "clash-backend", "hf = xbackend_example:SPEC")
    misnamed = dist(tmp_path / "c", "misnamed-backend", "other = xbackend_example:SPEC")
    out = run("""
import json
from engine.backends.registry import SPECS, PLUGIN_ERRORS, spec
from engine.errors import ConfigError
try:
    spec("broken")
    error = None
except ConfigError as err:
    error = {"field": err.field, "text": str(err)}
print(json.dumps({"names": list(SPECS), "hf_target": SPECS["hf"].target, "errors": PLUGIN_ERRORS, "error": error}))
""", broken, clash, misnamed, EXAMPLE)
    assert out["names"] == ["hf", "vllm", "llamacpp", "example"]  # the built-in hf is never replaced
    assert out["hf_target"] == "engine.backends.hf.backend:HfBackend"
    assert "ModuleNotFoundError" in out["errors"]["broken"]
    assert "a built-in backend" in out["errors"]["hf"]
    assert "must be the spec's name" in out["errors"]["other"]
    assert out["error"]["field"] == "backend"
    assert "broken = 'no_such_module_here:SPEC'" in out["error"]["text"] and "failed to load" in out["error"]["text"]
