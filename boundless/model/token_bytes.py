"""Each token's own bytes, as OpenAI's logprobs give them (``bytes``): what a client joins to rebuild the text, a
character split over tokens included.

A token's decoded text cannot give them: a token that holds part of a character decodes to U+FFFD, whose bytes
(``[239, 191, 189]``) are not the token's. They are read from the token's spelling in the vocabulary instead, as the
tokenizer's decoder would read it: byte-level BPE (GPT-2's, SmolLM's, Llama 3's, Qwen's) spells each byte as one
character of its alphabet; SentencePiece with a byte fallback (Llama 2's, Mistral's, Gemma's) spells a byte that no
piece holds as ``<0xNN>`` and a space as ``▁``. An added token (``<|im_start|>``, ``<think>``) is its text. A
tokenizer of any other kind gives its decoded text's bytes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from boundless.model.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character that spells each byte -> the byte. Printable bytes
    spell themselves; the others, in order, the characters from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def _decoder_steps(tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The steps of the tokenizer's decoder, as its JSON writes them (a ``Sequence``'s in order)."""
    decoder = tokenizer.backend.decoder
    if decoder is None:
        return []
    state = json.loads(decoder.__getstate__())
    return state.get("decoders", []) if state.get("type") == "Sequence" else [state]


class TokenBytes:
    """A tokenizer's tokens' own bytes (see the module docstring), each read once and kept: ``token_bytes(id)``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        steps = _decoder_steps(tokenizer)
        kinds = {step.get("type") for step in steps}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = tokenizer.byte_fallback
        # What the decoder writes for a piece's characters: SentencePiece's ▁ as a space (Metaspace, or Replace).
        self._replaced = [(step["replacement"], " ") for step in steps if step.get("type") == "Metaspace"] + [
            (step["pattern"]["String"], step["content"])
            for step in steps
            if step.get("type") == "Replace" and "String" in (step.get("pattern") or {})
        ]
        self._added = {i: token.content for i, token in tokenizer.backend.get_added_tokens_decoder().items()}
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._known.get(token_id)
        if found is None:
            found = self._known[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        piece = self._tokenizer.backend.id_to_token(token_id)
        if piece is not None and self._byte_fallback and (byte := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])  # (an added <0xNN> too: the decoder reads it so)
        if token_id in self._added:
            return self._added[token_id].encode()
        if piece is not None and self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if piece is not None and not self._byte_level and (self._byte_fallback or self._replaced):
            for old, new in self._replaced:
                piece = piece.replace(old, new)
            return piece.encode()
        # (A spelling this does not read: the decoded text, U+FFFD and all.)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
