"""The session ids that agents written for OpenAI's and Anthropic's APIs send, read as the program a call belongs to.

Autellix schedules programs, not calls, so a call must say which program it is part of. An agent written for
Boundless says so (``program_id``, ``X-Program-Id``); most agents are not, but they name their session anyway, for
their providers' caches and accounting, and a session is what Boundless calls a program:

- OpenAI's ``prompt_cache_key`` (Codex sends its conversation's id there);
- Claude Code's ``X-Claude-Code-Session-Id`` header (v2.1.86 on), and before it the ``session_id`` inside its
  ``metadata.user_id`` (a JSON object from v2.1.78, ``user_..._account_..._session_<id>`` before);
- Codex's ``session_id`` header (``session-id`` where a proxy rewrote it).

An explicit ``program_id`` or ``X-Program-Id`` wins over all of them (:func:`program_named`, every route's rule). A
session id too long to be a program id (:data:`~boundless.api.schemas.MAX_ID_CHARS`) is ignored, not refused: the
client did not send it for us.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from boundless.api.json_text import UNREADABLE_JSON
from boundless.api.schemas import MAX_ID_CHARS
from boundless.api.validation import header_identifier

# Headers that carry an agent's session id, the most specific first.
SESSION_HEADERS = ("X-Claude-Code-Session-Id", "session_id", "session-id")
_LEGACY_SESSION = "_session_"  # Claude Code's metadata.user_id before v2.1.78: user_<hash>_account_<id>_session_<id>


def _usable(value: object) -> str | None:
    return value if isinstance(value, str) and 1 <= len(value) <= MAX_ID_CHARS else None


def program_named(program_id: str | None, headers: Mapping[str, str], cache_key: str | None) -> str | None:
    """The program a call names, or None: its ``program_id`` or ``X-Program-Id`` (held to a program id's limits), else
    its agent's session: OpenAI's ``prompt_cache_key`` (``cache_key``; OpenAI takes any string there, and one that
    cannot be a program id is ignored, as it was before it named programs, not refused), else a session header."""
    return program_id or header_identifier(headers, "X-Program-Id") or _usable(cache_key) or header_session(headers)


def header_session(headers: Mapping[str, str]) -> str | None:
    """The session id an agent sent as a header (Claude Code's, Codex's), or None."""
    for name in SESSION_HEADERS:
        found = _usable(headers.get(name))
        if found is not None:
            return found
    return None


def claude_code_session(user_id: str) -> str | None:
    """The session id in Claude Code's ``metadata.user_id``, or None (another client's user id names a user, not a
    session)."""
    if user_id.startswith("{"):
        try:
            fields = json.loads(user_id)
        except UNREADABLE_JSON:
            return None
        return _usable(fields.get("session_id")) if isinstance(fields, dict) else None
    _, found, session = user_id.rpartition(_LEGACY_SESSION)
    return _usable(session) if found else None
