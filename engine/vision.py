"""The vision-language request: chat messages carrying exactly one image.

Images ride inside message content, in the transformers convention::

    [{"role": "user", "content": [{"type": "image", "image": <PIL image | path | bytes>},
                                  {"type": "text", "text": "Describe the image."}]}]

:meth:`VisionRequest.of` validates a request (exactly one image, known part types), loads the image as RGB,
and keeps template-ready messages (image parts without their payload) for the processor's chat template.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import RequestError
from engine.types import check_message, check_messages

PART_TYPES = ("text", "image")


def load_image(value: Any, where: str) -> Any:
    """A PIL image (RGB) from a PIL image, a file path, or encoded bytes."""
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (str, Path)):
        if not Path(value).is_file():
            raise RequestError(where, str(value), "is not an image file",
                               fix="give an existing path, bytes or a PIL image")
        image = Image.open(value)
    elif isinstance(value, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(value))
        except Exception as err:
            raise RequestError(where, f"<{len(value)} bytes>", f"could not be decoded as an image ({err})",
                               fix="give PNG/JPEG bytes, a path or a PIL image") from err
    else:
        raise RequestError(where, type(value).__name__, "must be a PIL image, a path or bytes",
                           fix="put the image under the part's 'image' key")
    return image.convert("RGB")


@dataclass(frozen=True)
class VisionRequest:
    """A chat request with exactly one image, validated.

    >>> from PIL import Image
    >>> req = VisionRequest.of([{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (8, 8))},
    ...                                                       {"type": "text", "text": "What is this?"}]}], index=0)
    >>> req.image.size, req.messages[0]["content"][0]
    ((8, 8), {'type': 'image'})
    >>> VisionRequest.of([{"role": "user", "content": "no image"}], index=4)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[4].images must count exactly one image, got 0. \
Fix: add one {'type': 'image', 'image': ...} part (use generate() for text-only requests).
    """

    messages: tuple[Mapping[str, Any], ...]
    image: Any

    @classmethod
    def of(cls, raw: VisionRequest | Sequence[Mapping[str, Any]], *, index: int) -> VisionRequest:
        if isinstance(raw, VisionRequest):
            return raw
        where = f"requests[{index}]"
        check_messages(raw, f"{where}.messages", fix="give at least one user message with an image part")
        messages: list[dict[str, Any]] = []
        images: list[tuple[str, Any]] = []
        for j, msg in enumerate(raw):
            at = f"{where}.messages[{j}]"
            check_message(msg, at, fix="write it as {'role': 'user', 'content': [...parts]}")
            content = msg.get("content")
            if isinstance(content, str):
                messages.append(dict(msg))
                continue
            if not isinstance(content, Sequence) or isinstance(content, (str, bytes)):
                raise RequestError(f"{at}.content", content, "must be a string or a list of parts",
                                   fix="use [{'type': 'image', 'image': ...}, {'type': 'text', 'text': ...}]")
            parts = []
            for k, part in enumerate(content):
                pat = f"{at}.content[{k}]"
                if not isinstance(part, Mapping):
                    raise RequestError(pat, part, "must be a mapping with a 'type'",
                                       fix="write {'type': 'text', 'text': ...} or {'type': 'image', 'image': ...}")
                kind = part.get("type")
                if kind not in PART_TYPES:
                    raise RequestError(f"{pat}.type", kind, f"must be one of {', '.join(PART_TYPES)}",
                                       fix="mark each part as 'text' or 'image'")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise RequestError(f"{pat}.text", part.get("text"), "must be a string", fix="give the text")
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    images.append((f"{pat}.image", part.get("image")))
                    parts.append({"type": "image"})
            messages.append({**msg, "content": parts})
        if len(images) != 1:
            raise RequestError(f"{where}.images", len(images), "must count exactly one image",
                               fix="add one {'type': 'image', 'image': ...} part (use generate() for text-only "
                                   "requests)" if not images else "send one image per request")
        (pat, value), = images
        return cls(messages=tuple(messages), image=load_image(value, pat))


def check_unresized(image: Any, *, index: int, grid: int, min_pixels: int, max_pixels: int) -> None:
    """With ``vision.do_resize: false`` the processor takes the image as it is: it must already fit the patch
    grid (width and height multiples of ``grid``, patch x merge size) and the pixel budget, or the request is
    refused here, before any generation, instead of failing inside the processor or ignoring the budget.

    >>> from PIL import Image
    >>> check_unresized(Image.new("RGB", (84, 56)), index=0, grid=28, min_pixels=3136, max_pixels=786432)
    >>> check_unresized(Image.new("RGB", (64, 64)), index=2, grid=28, min_pixels=3136, max_pixels=786432)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[2].image must have width and height that are multiples of 28 when \
vision.do_resize is false, got (64, 64). Fix: resize it to (56, 56) or (84, 84) yourself, or set vision.do_resize \
true.
    """
    width, height = image.size
    where = f"requests[{index}].image"
    if width % grid or height % grid:
        down = (max(grid, width // grid * grid), max(grid, height // grid * grid))
        up = (-(-width // grid) * grid, -(-height // grid) * grid)
        raise RequestError(where, (width, height),
                           f"must have width and height that are multiples of {grid} when vision.do_resize is false",
                           fix=f"resize it to {down} or {up} yourself, or set vision.do_resize true")
    if not min_pixels <= width * height <= max_pixels:
        raise RequestError(where, (width, height),
                           f"has {width * height} pixels, outside the budget [{min_pixels}, {max_pixels}] that "
                           "vision.do_resize false cannot enforce",
                           fix="resize it into the budget yourself, widen vision.min_pixels/max_pixels, or set "
                               "vision.do_resize true")
