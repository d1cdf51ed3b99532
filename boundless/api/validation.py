"""Checks at the HTTP edge that the request types cannot express, so that bad input is answered with a 400 here
and never reaches an engine (where it could fail a whole step, or an instance of a cluster).

Each check raises :class:`~boundless.api.errors.APIError` (400) naming the parameter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from boundless.api.errors import APIError
from boundless.api.schemas import MAX_ID_CHARS

_UNENCODABLE = "is not valid Unicode (it holds a lone surrogate)"
_NOT_FINITE = "is not a finite number (JSON has no NaN or Infinity)"
# How deep a body's objects and arrays may nest: deeper, what reads them recursively (a chat template's tojson, the
# JSON writer, this module's walk itself, which was recursive) ran out of stack, a 500.
MAX_BODY_DEPTH = 128
_TOO_DEEP = f"nests more than {MAX_BODY_DEPTH} levels deep"


def _invalid_path(value: Any) -> tuple[str | None, str] | None:
    """The path of the first value in ``value`` that JSON cannot carry, and why: a string, key or value, that is not
    valid Unicode, a number that is NaN or infinite (Python's JSON reads ``NaN``, ``Infinity`` and ``1e999``), or an
    object or array nested past :data:`MAX_BODY_DEPTH`. Walked with a stack of its own, in the body's order."""
    stack: list[tuple[Any, str, int, Any]] = [(value, "", 0, None)]  # (value, path, depth, the key that names it)
    while stack:
        node, path, depth, key = stack.pop()
        if isinstance(key, str) and not _encodes(key):
            return path, _UNENCODABLE
        if isinstance(node, str):
            if not (node.isascii() or _encodes(node)):
                return path or None, _UNENCODABLE
        elif isinstance(node, float):
            if not math.isfinite(node):
                return path or None, _NOT_FINITE
        elif isinstance(node, (Mapping, list, tuple)):
            if depth >= MAX_BODY_DEPTH:
                return path or None, _TOO_DEEP
            items = node.items() if isinstance(node, Mapping) else enumerate(node)
            children = [(item, f"{path}.{k}" if path else str(k), depth + 1, k) for k, item in items]
            stack.extend(reversed(children))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_valid_text(body: Mapping[str, Any]) -> None:
    """400 if any text of the request is not valid Unicode (it could not be tokenized, matched or sent back), or any
    of its numbers, at any depth, is NaN or infinite: a schema or metadata holding one could not be sent back in a
    response (JSON has none), nor compiled to a grammar."""
    found = _invalid_path(body)
    if found is not None:
        path, why = found
        code = "invalid_encoding" if why == _UNENCODABLE else "invalid_value"
        raise APIError(400, f"{path or 'body'} {why}", path, code)


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


# How deep a grammar's JSON (a schema, a structural tag) may nest: xgrammar's compilation time grows with about the
# cube of a schema's depth (300 levels of arrays took 3 s, 900 minutes, a worker thread's and the engine's), and
# OpenAI serves schemas 10 levels deep at most.
MAX_JSON_DEPTH = 64


def json_depth(text: str) -> int:
    """How deep JSON text's objects and arrays nest (0 for a scalar), read from its brackets outside strings: without
    recursion, for text of any depth."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # (unrolled: fast on long strings)
_BRACKETS = re.compile(r"[\[\]{}]")


def require_shallow_json(text: str | None, param: str, what: str) -> None:
    """400 if JSON text (``what``, at ``param``) nests more than :data:`MAX_JSON_DEPTH` levels."""
    if text is not None and (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise APIError(
            400,
            f"{param}: the {what} nests {depth} levels deep; at most {MAX_JSON_DEPTH} are served (a grammar's "
            "compilation grows with the cube of its depth)",
            param,
            "invalid_value",
        )


def header_identifier(headers: Mapping[str, str], name: str) -> str | None:
    """A program or thread id sent as a header, held to the limits of the body's fields."""
    value = headers.get(name)
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise APIError(400, f"the {name} header must have 1 to {MAX_ID_CHARS} characters", name, "invalid_value")
    return value


def validated_body(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` as ``model``; a mismatch is the 400 that FastAPI's own body checks give (naming the field)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise RequestValidationError(errors, body=body) from None
