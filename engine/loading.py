"""Model-side loading shared by every backend: the one tokenizer, left padding, the pad-token fallback.

The engine loads the tokenizer once; it renders every prompt and decodes every output, whichever
backend generates. Decoder-only batches are left-padded. When the tokenizer has no pad token, the EOS
token becomes the pad token and that fallback is recorded (``LoadInfo.pad_token_fallback``) and logged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.errors import BackendUnavailableError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadInfo:
    """Facts about how the tokenizer was prepared, copied into every result's meta."""

    pad_token_fallback: bool
    """True when the tokenizer had no pad token and EOS was used instead."""
    eos_token_ids: tuple[int, ...]
    """The ids that end a row besides ``stop.token_ids``, decided here for every backend: the tokenizer's EOS, then
    (``model.checkpoint_eos``) the checkpoint's ``generation_config.json`` ones."""


def check_model_dir(model: ModelConfig) -> Path:
    """The model folder (or, for the llamacpp backend, a ``.gguf`` file), checked to exist."""
    path = Path(model.path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError("model.path", model.path, "is not a GGUF file on this machine",
                              fix="give the path of a local .gguf file, or a folder with one and its tokenizer")
        return path
    if not path.is_dir():
        raise ConfigError("model.path", model.path, "is not a local model directory",
                          fix="give a folder with config.json and tokenizer files (no hub downloads here); "
                              "build the fixtures with `python -m engine_fixtures build`")
    if not (path / "config.json").is_file():
        raise ConfigError("model.path", model.path, "has no config.json", fix="point at a Hugging Face checkpoint")
    return path


def is_vision_model(model: ModelConfig) -> bool:
    """True when the checkpoint is a vision-language model (its config has a vision tower)."""
    if check_model_dir(model).suffix == ".gguf":
        return False  # a bare GGUF file: the llamacpp backend serves text models only
    config = json.loads((check_model_dir(model) / "config.json").read_text())
    return "vision_config" in config


def load_processor(model: ModelConfig) -> Any:
    """The model's multimodal processor (it owns the VLM chat template), or None for text-only models.

    Where torchvision is absent (CPU hosts), :mod:`engine.compat.torchvision` is activated first.
    """
    if not is_vision_model(model):
        return None
    from engine.compat import torchvision as tv_compat

    tv_compat.install()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    if not hasattr(processor, "image_processor"):
        raise ConfigError("model.path", model.path, "is a vision model whose processor has no image processor",
                          fix="save the image processor (preprocessor_config.json) with the checkpoint")
    return processor


def load_tokenizer(model: ModelConfig, processor: Any = None) -> tuple[Any, LoadInfo]:
    """Load the shared tokenizer (the processor's, for VLMs): left padding, pad := EOS when absent (recorded)."""
    path = check_model_dir(model)
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise BackendUnavailableError("engine", f"transformers is not installed ({err})",
                                      "pip install 'xbackend-engine[hf]' (the tokenizer comes from "
                                      "transformers)") from err
    if processor is not None:
        tokenizer = processor.tokenizer
    elif path.suffix == ".gguf":  # the tokenizer and chat template stored in the GGUF (read with the gguf package)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=model.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.eos_token_id is None:
        raise ConfigError("model.path", model.path, "has a tokenizer without an EOS token",
                          fix="set eos_token in tokenizer_config.json")
    fallback = False
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        fallback = True
        log.warning("tokenizer of %s has no pad token; using EOS %r as pad", model.path, tokenizer.eos_token)
    eos = (int(tokenizer.eos_token_id),)
    if model.checkpoint_eos:
        eos = tuple(dict.fromkeys((*eos, *checkpoint_eos_ids(model))))
    return tokenizer, LoadInfo(pad_token_fallback=fallback, eos_token_ids=eos)


def checkpoint_eos_ids(model: ModelConfig) -> tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list) of the checkpoint's ``generation_config.json`` (next to a GGUF file);
    asked for with ``model.checkpoint_eos`` and absent: a ``ConfigError``."""
    path = check_model_dir(model)
    file = (path.parent if path.suffix == ".gguf" else path) / "generation_config.json"
    found = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    if found is None:
        raise ConfigError("model.checkpoint_eos", True, f"asks for the checkpoint's EOS ids but {file} "
                          f"{'has no eos_token_id' if file.is_file() else 'does not exist'}",
                          fix="set model.checkpoint_eos false, or add stop.token_ids for the ids to end at")
    ids = [found] if isinstance(found, int) else found
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError("model.checkpoint_eos", True, f"found eos_token_id {found!r} in {file}, not token ids",
                          fix="fix the checkpoint's generation_config.json, or set model.checkpoint_eos false")
    return tuple(ids)
