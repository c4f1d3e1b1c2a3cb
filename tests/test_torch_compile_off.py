"""``engine.backends.vllm.backend.turn_torch_compile_off``: what the suite's CPU runs set before any engine starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.backends.host import TORCH_COMPILE_OFF, turn_torch_compile_off


@pytest.fixture
def unset(monkeypatch):
    """The switch unset for the test, and restored after it whatever the function wrote."""
    for name in TORCH_COMPILE_OFF:
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)


def test_sets_the_switch_for_this_process_and_its_children(unset):
    assert turn_torch_compile_off() is True
    import os

    assert all(os.environ[name] == "1" for name in TORCH_COMPILE_OFF)
    probe = ("import torch, torch._dynamo.config as c\n"
             "f = lambda x: x + 1\n"
             "print(c.disable, torch.compile(f) is f)")
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert child.stdout.split() == ["True", "True"], "a process started afterwards (a server, an engine core) " \
        f"compiles nothing: {child.stdout} {child.stderr[-500:]}"


def test_a_users_own_setting_wins(unset, monkeypatch):
    monkeypatch.setenv(TORCH_COMPILE_OFF[1], "0")
    assert turn_torch_compile_off() is False
    import os

    assert os.environ[TORCH_COMPILE_OFF[1]] == "0" and TORCH_COMPILE_OFF[0] not in os.environ


def test_an_already_imported_dynamo_is_switched_too(unset, monkeypatch):
    import torch._dynamo.config as config

    monkeypatch.setattr(config, "disable", False)
    turn_torch_compile_off()
    assert config.disable is True

    import torch

    calls = []

    @torch.compile
    def double(x):
        calls.append(1)
        return x * 2

    assert double(torch.ones(2)).tolist() == [2.0, 2.0] and calls == [1], "ran as plain torch ops"
