"""The torchvision compatibility layer is active only where torchvision is absent."""

from __future__ import annotations

import importlib.machinery
import sys

import pytest

from engine.compat import torchvision as tv_compat


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setitem(tv_compat._state, "installed", False)
    monkeypatch.setenv("PYTHONPATH", "")


def test_stays_inactive_when_torchvision_is_present(monkeypatch, fresh_state):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "torchvision":
            return importlib.machinery.ModuleSpec("torchvision", None)
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    before = {k: v for k, v in sys.modules.items() if k.startswith("transformers")}
    assert tv_compat.install() is False
    assert not tv_compat.is_active()
    assert tv_compat.IMAGE_MODULE not in sys.modules or sys.modules[tv_compat.IMAGE_MODULE] is before.get(
        tv_compat.IMAGE_MODULE)
    assert str(tv_compat.SITE_DIR) not in __import__("os").environ["PYTHONPATH"]


@pytest.mark.skipif(tv_compat.torchvision_available(), reason="torchvision is installed: nothing to patch here")
def test_active_without_torchvision_builds_the_qwen2_vl_processor(tmp_path, fresh_state, monkeypatch):
    pytest.importorskip("transformers", reason="the Qwen2-VL processor needs transformers (`nox -s tests` has it)")
    monkeypatch.delitem(sys.modules, tv_compat.IMAGE_MODULE, raising=False)
    assert tv_compat.install() is True and tv_compat.is_active()
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize

    assert Qwen2VLImageProcessor.__name__ == "Qwen2VLImageProcessorPil"
    assert smart_resize(500, 300, factor=28, min_pixels=3136, max_pixels=100352) == (392, 224)
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor  # as processing_auto reaches it

    stand_in = AutoVideoProcessor.from_pretrained(tmp_path)
    assert stand_in.merge_size == 2
    with pytest.raises(RuntimeError, match="torchvision"):
        stand_in([])
    assert str(tv_compat.SITE_DIR) in __import__("os").environ["PYTHONPATH"]


@pytest.mark.skipif(tv_compat.torchvision_available(), reason="torchvision is installed: nothing to patch here")
def test_the_start_up_hook_imports_nothing_until_a_patched_module_is_imported():
    """Every Python subprocess of a CPU host loads the hook (pip, lm-eval's CLI, vLLM's engine core and workers):
    importing transformers' processing modules there took 6-8 s of each start. The hook now waits for the modules."""
    pytest.importorskip("transformers", reason="the Qwen2-VL processor needs transformers (`nox -s tests` has it)")
    import os
    import subprocess
    from pathlib import Path

    code = ("import sys; before = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'); "
            "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor; "
            "from transformers.processing_utils import ProcessorMixin; "
            "print(before, Qwen2VLImageProcessor.__name__, "
            "ProcessorMixin.get_possibly_dynamic_module('VideoProcessorMixin').__name__)")
    root = str(Path(tv_compat.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tv_compat.SITE_DIR), root])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "Qwen2VLImageProcessorPil", "VideoProcessorMixin"], out
