"""Model variants built at test time: a fixture's folder copied (weights symlinked) with its files edited."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def model_copy(model: Path, out: Path, *, generation_config: dict[str, Any] | None = None,
               drop_pad: bool = False) -> Path:
    """``model`` copied to ``out`` (weights and GGUFs symlinked): ``generation_config`` written as its
    ``generation_config.json``; ``drop_pad``: its pad token removed from the tokenizer and model configs."""
    out.mkdir()
    for item in model.iterdir():
        if item.suffix in (".safetensors", ".gguf"):
            os.symlink(item.resolve(), out / item.name)
        elif item.is_file():
            shutil.copy2(item, out / item.name)
    if drop_pad:
        for name, key in (("tokenizer_config.json", "pad_token"), ("config.json", "pad_token_id")):
            data = json.loads((out / name).read_text())
            data.pop(key, None)
            (out / name).write_text(json.dumps(data))
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config))
    return out


def answered_token(results: Any, start: int = 2) -> int:
    """A token some answer produces for the first time at position ``start`` or later, and not as its last."""
    for r in results:
        ids = list(r.token_ids)
        for i in range(start, len(ids) - 1):
            if ids[i] not in ids[:i]:
                return ids[i]
    raise AssertionError("no answer has a new token past its first positions; lengthen the budget")
