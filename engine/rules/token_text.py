"""The cheap incremental text path for rules that read text: per-token byte strings, built once per tokenizer.

``tokenizer.decode`` per token (twice, to find the delta) costs microseconds per token per row; a table lookup
and an incremental UTF-8 decoder cost a fraction of that. The table reproduces the tokenizer's own decoder:

* **byte-level BPE** (GPT-2 style, ``ByteLevel`` decoder): each character of a token stands for one byte;
* **SentencePiece** style (``Metaspace`` decoder, or ``Replace("▁", " ")`` + ``ByteFallback`` + ``Fuse`` +
  ``Strip``): ``▁`` is a space, ``<0xAB>`` pieces are raw bytes, and the text's first leading space is dropped;
* special tokens give nothing (as ``skip_special_tokens=True``).

Bytes become text through an incremental UTF-8 decoder: a character split across tokens is held back until it
is complete, invalid bytes become U+FFFD as in ``decode``. So whenever no character is incomplete, the text
pushed so far equals ``tokenizer.decode(ids, skip_special_tokens=True)`` of the prefix (a property test checks
this on random and real streams; mid-character, byte-level ``decode`` only adds U+FFFD for the held bytes).

One documented exception: a run of SentencePiece byte pieces that is *invalid* UTF-8 (garbage, not a character
split across tokens) decodes in ``tokenizers`` to one U+FFFD per byte of the whole run, valid bytes included,
which no incremental reader can know in advance; here it gives one U+FFFD per invalid subsequence, as
byte-level decoders do. Tokenizers whose decoder is not one of these (or that clean up spaces after decoding)
get ``None`` from :meth:`TokenBytes.from_tokenizer`; callers then fall back to
:class:`engine.rules.detok.IncrementalDetokenizer`, which is correct for any tokenizer, only slower.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed: character -> byte.

    >>> alphabet = byte_level_alphabet()
    >>> alphabet["Ġ"], alphabet["a"], len(alphabet)
    (32, 97, 256)
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TextStream:
    """One row's text: push token ids, get the text each adds (possibly empty while a character is incomplete).

    >>> table = TokenBytes([b"He", b"llo", b" \\xe2\\x82", b"\\xac", b""], special={4})
    >>> s = table.stream()
    >>> [s.push(t) for t in (0, 1, 4, 2, 3)]
    ['He', 'llo', '', ' ', '€']
    """

    __slots__ = ("_decoder", "_pieces", "_special", "_strip_first")

    def __init__(self, table: TokenBytes) -> None:
        self._pieces = table.pieces
        self._special = table.special
        self._strip_first = table.strip_first_space
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if token in self._special or not 0 <= token < len(self._pieces):
            return ""
        piece = self._pieces[token]
        if self._strip_first and piece:
            self._strip_first = False
            if piece[:1] == b" ":
                piece = piece[1:]
        return self._decoder.decode(piece)

    def pending(self) -> bool:
        """Whether bytes of an incomplete character are held back."""
        return bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        """The end of the text: held-back bytes become U+FFFD (as ``decode`` shows them)."""
        return self._decoder.decode(b"", final=True)


class TokenBytes:
    """Each token id's bytes for one tokenizer; :meth:`stream` starts a row.

    ``special`` ids give no text; ``strip_first_space`` drops one leading space of the whole text (SentencePiece).
    """

    def __init__(self, pieces: Sequence[bytes], *, special: set[int] | frozenset[int] = frozenset(),
                 strip_first_space: bool = False, kind: str = "table") -> None:
        self.pieces = list(pieces)
        self.special = frozenset(special)
        self.strip_first_space = strip_first_space
        self.kind = kind

    def stream(self) -> TextStream:
        return TextStream(self)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenBytes | None:
        """The table for a Hugging Face fast tokenizer, or None when its decoder is not understood here."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except (ValueError, AttributeError):
            return None
        kind = _decoder_kind(decoder)
        if kind is None:
            return None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {i for i, tok in added.items() if getattr(tok, "special", False)}
        special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
        size = max(len(tokenizer), backend.get_vocab_size(with_added_tokens=True))
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        if kind == "byte_level":
            alphabet = byte_level_alphabet()
            pieces = [b"" if t is None else b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode()
                                                     for c in t) for t in tokens]
            return cls(pieces, special=special, kind=kind)
        replacement = decoder.get("replacement", "▁") if decoder.get("type") == "Metaspace" else "▁"
        byte_fallback = "ByteFallback" in _step_names(decoder)
        pieces = []
        for t in tokens:
            match = BYTE_PIECE.match(t or "") if byte_fallback else None
            pieces.append(bytes([int(match.group(1), 16)]) if match else (t or "").replace(replacement, " ").encode())
        return cls(pieces, special=special, strip_first_space=kind == "sentencepiece_strip", kind=kind)


def _decoder_kind(decoder: dict[str, Any]) -> str | None:
    """"byte_level", "sentencepiece_strip", "sentencepiece" for decoders reproduced here, else None."""
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level"
    if kind == "Metaspace":
        return "sentencepiece_strip" if decoder.get("prepend_scheme", "always") in ("always", "first") else \
            "sentencepiece"
    if kind != "Sequence":
        return None
    steps = decoder.get("decoders", [])
    names = _step_names(decoder)
    if not names or names[0] != "Replace":
        return None
    if steps[0].get("pattern", {}).get("String") != "▁" or steps[0].get("content") != " ":
        return None
    if names in (["Replace"], ["Replace", "ByteFallback"], ["Replace", "ByteFallback", "Fuse"], ["Replace", "Fuse"]):
        return "sentencepiece"
    if names in (["Replace", "ByteFallback", "Fuse", "Strip"], ["Replace", "Fuse", "Strip"]):
        strip = steps[-1]  # after Fuse: it strips the whole text's first character
        if strip.get("content") == " " and strip.get("start") == 1 and strip.get("stop") == 0:
            return "sentencepiece_strip"
    return None


def _step_names(decoder: dict[str, Any]) -> list[str]:
    return [d.get("type") for d in decoder.get("decoders", [])]
