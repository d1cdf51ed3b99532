"""Checks at the HTTP edge that the request types cannot express, so that bad input is answered with a 400 here
and never reaches an engine (where it could fail a whole step, or an instance of a cluster).

Each check raises :class:`~boundless.api.errors.APIError` (400) naming the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from boundless.api.errors import APIError
from boundless.api.schemas import MAX_ID_CHARS


def unencodable_path(value: Any, path: str = "") -> str | None:
    """The path (``messages.0.content``) of the first string in ``value``, key or value, that is not valid Unicode
    (a lone surrogate, which JSON can spell ``"\\ud800"``), or None."""
    if isinstance(value, str):
        return None if value.isascii() or _encodes(value) else (path or None)
    if isinstance(value, Mapping):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _encodes(key):
                return sub
            found = unencodable_path(item, sub)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = unencodable_path(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_valid_text(body: Mapping[str, Any]) -> None:
    """400 if any text of the request is not valid Unicode: it could not be tokenized, matched or sent back."""
    path = unencodable_path(body)
    if path is not None:
        raise APIError(400, f"{path} is not valid Unicode (it holds a lone surrogate)", path, "invalid_encoding")


# vLLM's structured-output fields before ``structured_outputs`` (removed in vLLM 0.12): each would otherwise be taken
# as an unknown field and ignored, leaving the output unconstrained without a word.
REMOVED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def refuse_removed_fields(extra: Mapping[str, Any] | None) -> None:
    """400 for a field vLLM removed whose effect this server would silently drop, naming what replaced it."""
    for name in extra or ():
        if name in REMOVED_FIELDS:
            new = f'{{"structured_outputs": {{"{REMOVED_FIELDS[name]}": ...}}}}'
            raise APIError(400, f"{name} was removed (as in vLLM 0.12); send {new}", name, "unsupported_parameter")


def require_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """400 unless every id is a token of the vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is not in [0, {vocab_size})", param, "invalid_value")


def header_identifier(headers: Mapping[str, str], name: str) -> str | None:
    """A program or thread id sent as a header, held to the limits of the body's fields."""
    value = headers.get(name)
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise APIError(400, f"the {name} header must have 1 to {MAX_ID_CHARS} characters", name, "invalid_value")
    return value
