"""A conversation in OpenAI's message shapes as chat templates read it, as vLLM hands it to them: the one conversion
the server's chat route (``OpenAIServer.chat_prompt``) and the offline ``LLM.chat`` share.

Each message's content comes in both of vLLM's content formats (a :class:`TemplateConversation`), and the template
picks: most read it as one text, content given as a list of text parts joined by newlines; a template that loops over
a message's content (``{% for part in message['content'] %}``) reads a list of text parts, a string being one part (a
tool result stays one text: vLLM joins its parts for every template). Content ``None`` (an assistant turn that only
made calls) is empty: ``""``, or no parts. ``developer`` is ``system``; an assistant's calls (with their JSON arguments
as objects, ``template_messages``) and a tool result's ``tool_call_id`` pass, on those roles only, as vLLM passes
them; an earlier turn's reasoning passes under its own name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from boundless.api.schemas import ROLES, TEXT_PART_SEPARATOR, InvalidContentPart, part_texts
from boundless.api.tool_calls import template_messages
from boundless.model.tokenizer import REASONING_FIELDS, TemplateConversation


class InvalidMessage(ValueError):
    """A message the conversation cannot take; ``param`` is its path in the request (``messages.2.content``)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _texts(content: Any, i: int) -> list[str]:
    """The texts of a message's content: a string's one, a list of text parts' each (checked), None's none."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    try:
        return part_texts(content)
    except InvalidContentPart as e:
        raise InvalidMessage(str(e), f"messages.{i}.content.{e.index}", "invalid_value") from e


def template_conversation(messages: Sequence[Mapping[str, Any]], strict: bool = True) -> TemplateConversation:
    """The messages as a chat template reads them (see the module docstring); raises :class:`InvalidMessage`.
    ``strict`` (the server's): OpenAI's roles only, content on every message but an assistant's, and the keys the
    API defines. Otherwise (``LLM.chat``) any role, and every other key, pass as given (a template may read them:
    Llama-3.1's ``ipython`` role), as transformers passes them."""
    as_text: list[dict[str, Any]] = []
    as_parts: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if strict and role not in ROLES:
            raise InvalidMessage(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"messages.{i}.role")
        content = m.get("content")
        if strict and content is None and role != "assistant":
            raise InvalidMessage(f"a {role} message needs content", f"messages.{i}.content", "invalid_value")
        msg: dict[str, Any] = {} if strict else dict(m)
        msg["role"] = "system" if role == "developer" else role
        if strict:  # (vLLM's: calls on an assistant's turn only, a call's id on a tool result's)
            if role == "assistant" and m.get("tool_calls"):
                msg["tool_calls"] = m["tool_calls"]
            if role == "tool" and m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        # An earlier turn's reasoning, under any of its names (templates that keep it read it; others ignore it)
        msg.update((k, v) for k, v in m.items() if k in REASONING_FIELDS and isinstance(v, str))
        if content is not None and not isinstance(content, str | list):  # (LLM.chat's: a template may read it)
            as_text.append({**msg, "content": content})
            as_parts.append({**msg, "content": content})
            continue
        texts = _texts(content, i)
        text = TEXT_PART_SEPARATOR.join(texts)
        as_text.append({**msg, "content": text})
        parts = [{"type": "text", "text": t} for t in texts]
        as_parts.append({**msg, "content": text if role == "tool" else parts})
    return TemplateConversation(template_messages(as_text), template_messages(as_parts))
