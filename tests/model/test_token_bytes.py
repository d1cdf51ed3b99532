"""Each token's own bytes (``TokenBytes``, the logprobs' ``bytes``), for byte-level BPE and SentencePiece's byte
fallback: a token that holds part of a character gives its bytes, not U+FFFD's."""

from __future__ import annotations

from pathlib import Path

from boundless.model.loader import LoadedModel
from boundless.model.random_model import write_byte_fallback_tokenizer
from boundless.model.token_bytes import TokenBytes
from boundless.model.tokenizer import Tokenizer, load_tokenizer

REPLACEMENT = "\ufffd".encode()


def test_byte_level_tokens_are_their_spellings_bytes(smollm2: LoadedModel) -> None:
    """Every token of SmolLM2's vocabulary: its bytes are its decoded text's where that text is whole characters, and
    part of a character (so not valid UTF-8) exactly where the text is U+FFFD."""
    tokenizer = smollm2.tokenizer
    token_bytes = TokenBytes(tokenizer)
    partial = 0
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        try:
            assert token_bytes(token_id).decode() == text, token_id
        except UnicodeDecodeError:
            assert "\ufffd" in text, token_id
            partial += 1
    assert partial > 100  # (the vocabulary's pieces of characters: each was U+FFFD's bytes)
    ids = tokenizer.encode("naïve 日本語 😀", add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == "naïve 日本語 😀".encode()


def _sentencepiece_tokenizer(root: Path) -> Tokenizer:
    """A small Llama-2-style tokenizer: SentencePiece's ▁ for a space, and a byte fallback (``<0xNN>`` tokens) for
    the characters its pieces do not hold."""
    return load_tokenizer(write_byte_fallback_tokenizer(root, ["hello world, the quick brown fox"] * 20, 120))


def test_sentencepiece_byte_tokens_are_their_bytes_and_pieces_their_text(tmp_path: Path) -> None:
    """``<0xNN>`` is the byte NN (a character the pieces lack comes as its UTF-8 bytes, each of which decodes alone
    to U+FFFD), a piece its text with ▁ as a space (the decoder strips the first text's leading one; the bytes of
    a token are its own wherever it stands), an added token its text."""
    tokenizer = _sentencepiece_tokenizer(tmp_path / "spm")
    token_bytes = TokenBytes(tokenizer)
    text = "hello wörld 😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    fallen_back = [i for i in ids if tokenizer.decode([i]) == "\ufffd"]
    assert len(fallen_back) == len("ö😀".encode())  # (each of their bytes a token of its own)
    assert [token_bytes(i) for i in fallen_back] == [bytes([b]) for b in "ö😀".encode()]
    assert b"".join(token_bytes(i) for i in ids) == b" " + text.encode()  # (the ▁ before the first word too)
    assert token_bytes(tokenizer.backend.token_to_id("</s>")) == b"</s>"
    assert REPLACEMENT not in b"".join(token_bytes(i) for i in ids)
