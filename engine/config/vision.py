"""The image pixel budget, applied identically by every backend's image processor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.config.validation import check_range, check_type, merge
from engine.errors import ConfigError

DEFAULT_MAX_PIXELS = 786432  # the original runtime's budget
DEFAULT_MIN_PIXELS = 3136  # 56 x 56, Qwen2-VL's own floor


@dataclass(frozen=True)
class PixelBudget:
    """How many pixels an image may keep after resizing (Qwen2-VL-family processors: pixel *areas*).

    The budget reaches the processors as ``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``
    (transformers' replacement for the call-time ``min_pixels``/``max_pixels`` it deprecated) and, for vLLM,
    per request (never at engine start: vLLM silently ignores per-request sizes once one was set at start).

    >>> PixelBudget(max_pixels=100352).as_processor_kwargs()
    {'size': {'shortest_edge': 3136, 'longest_edge': 100352}, 'do_resize': True}
    >>> PixelBudget(min_pixels=9000, max_pixels=4000)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: vision.min_pixels must be at most vision.max_pixels (4000), got 9000. \
Fix: lower vision.min_pixels or raise vision.max_pixels.
    """

    max_pixels: int = DEFAULT_MAX_PIXELS
    """Most pixels (height x width) an image keeps; larger images are downscaled. In [1, inf)."""
    min_pixels: int = DEFAULT_MIN_PIXELS
    """Fewest pixels an image keeps; smaller images are upscaled. In [1, max_pixels]."""
    do_resize: bool = True
    """Resize to the budget (and to the patch grid). False: images must already fit the grid."""

    def __post_init__(self) -> None:
        for name in ("max_pixels", "min_pixels"):
            check_type(f"vision.{name}", getattr(self, name), int, "an integer pixel count")
            check_range(f"vision.{name}", getattr(self, name), low=1)
        if self.min_pixels > self.max_pixels:
            raise ConfigError("vision.min_pixels", self.min_pixels,
                              f"must be at most vision.max_pixels ({self.max_pixels})",
                              fix="lower vision.min_pixels or raise vision.max_pixels")
        check_type("vision.do_resize", self.do_resize, bool, "true or false")

    def merged(self, overrides: PixelBudget | Mapping[str, Any] | None) -> PixelBudget:
        """This budget with ``overrides`` applied (a whole budget replaces it)."""
        return merge(self, overrides, "vision")

    def as_processor_kwargs(self) -> dict[str, object]:
        return {"size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "do_resize": self.do_resize}
