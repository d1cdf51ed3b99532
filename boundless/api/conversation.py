"""A conversation in OpenAI's message shapes as chat templates read it: the one conversion the server's chat route
(``OpenAIServer.chat_prompt``) and the offline ``LLM.chat`` share.

Content given as a list of text parts is joined by newlines (as vLLM joins them); an assistant turn that only made
calls (content ``None`` or left out) has empty content, which templates read as text; ``developer`` is ``system``; a
call's JSON arguments are objects (``template_messages``); an earlier turn's reasoning passes under its own name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from boundless.api.schemas import ROLES, InvalidContentPart, message_text
from boundless.api.tool_calls import template_messages
from boundless.model.tokenizer import REASONING_FIELDS


class InvalidMessage(ValueError):
    """A message the conversation cannot take; ``param`` is its path in the request (``messages.2.content``)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def template_conversation(messages: Sequence[Mapping[str, Any]], strict: bool = True) -> list[dict[str, Any]]:
    """The messages as a chat template reads them (see the module docstring); raises :class:`InvalidMessage`.
    ``strict`` (the server's): OpenAI's roles only, content on every message but an assistant's, and the keys the
    API defines. Otherwise (``LLM.chat``) any role, and every other key, pass as given (a template may read them:
    Llama-3.1's ``ipython`` role), as transformers passes them."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if strict and role not in ROLES:
            raise InvalidMessage(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"messages.{i}.role")
        content = m.get("content")
        if strict and content is None and role != "assistant":
            raise InvalidMessage(f"a {role} message needs content", f"messages.{i}.content", "invalid_value")
        try:
            text = message_text(content) if content is not None or role == "assistant" else None
        except InvalidContentPart as e:
            raise InvalidMessage(str(e), f"messages.{i}.content.{e.index}", "invalid_value") from e
        msg: dict[str, Any] = {} if strict else dict(m)
        msg.update(role="system" if role == "developer" else role, content=text)
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        # An earlier turn's reasoning, under any of its names (templates that keep it read it; others ignore it)
        msg.update((k, v) for k, v in m.items() if k in REASONING_FIELDS and isinstance(v, str))
        out.append(msg)
    return template_messages(out)
