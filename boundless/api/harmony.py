"""OpenAI's harmony format (gpt-oss's output): its messages, each one reasoning, answer or a function call.

After a prompt that ends with ``<|start|>assistant`` the model writes one or more messages: a header, ``<|message|>``,
a body, and an end tag, each message after the first opened by ``<|start|>`` and its role::

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Tokyo"}<|call|>

The header names the message's channel (``analysis``: the chain of thought; ``final``: the answer; ``commentary``:
calls, and without a recipient a preamble meant for the user) and, for a call, its recipient (``to=functions.NAME``,
before or after the channel; ``<|constrain|>json`` or `` json`` may follow). The tags are special tokens, so the text
read here keeps them (the route decodes with special tokens under these parsers). ``<|return|>`` and ``<|call|>`` are
end-of-sequence tokens, left out of a finished output's text, and an output may be cut off anywhere (``max_tokens``):
a message without its end tag ends with the text.

:func:`messages` finds the messages; :func:`read` tells the reasoning (``analysis`` bodies, and messages to a
recipient that is no function: a built-in tool's, which this server does not run) from the answer (``final`` bodies and
preambles, joined by a newline as vLLM joins them) and the calls (a ``functions.`` recipient, whatever the channel).
The calls stay in the answer, for ``tool_calls`` to read, in one fixed form (:func:`call_markup`): the recipient's
name, then the body, which is the call's arguments, and ``<|call|>`` once the message ended. The answer is then
read for calls as any other format's is (:class:`HarmonyCallScanner` streams them).

Before the output is final, a message's header is held until it is whole (its channel decides where its body goes) and
a body's tail that may begin a tag is held back, so that what a longer text gives extends what a shorter one gave: a
stream sends each piece once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from boundless.api.call_scanner import CallSpan
from boundless.api.logprobs import Stretch

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN, END_OF_TEXT = "<|end|>", "<|call|>", "<|return|>", "<|endoftext|>"
# A body ends at a tag that ends its message, or at one that opens the next message's header (a model that left out
# the end tag); the first are its own, the second the next message's.
_CLOSERS = (END, CALL, RETURN, END_OF_TEXT)
_OPENERS = (START, CHANNEL)
_BODY_END = re.compile("|".join(re.escape(t) for t in (*_CLOSERS, *_OPENERS)))
# A header ends at <|message|>; a message with no body ends at an end tag; a new <|start|> drops a header left unended.
_HEADER_END = re.compile("|".join(re.escape(t) for t in (MESSAGE, *_CLOSERS, START)))
# How a header may begin: the output's first one follows the prompt's <|start|>assistant, so it opens with its channel
# or its recipient; the others with <|start|>.
_HEADER_OPENINGS = (START, CHANNEL, CONSTRAIN, MESSAGE, "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."
ANALYSIS = "analysis"
# A message's part of the output.
REASONING, CONTENT, FUNCTION_CALL = "reasoning", "content", "call"
SEPARATOR = "\n"  # (between two messages' bodies of the same part, as vLLM's parse_chat_output joins them)
# The form of a call in an answer (:func:`call_markup`): the tag and the function's name, then the body.
CALL_TAG = START + "assistant to=" + FUNCTIONS


@dataclass(frozen=True)
class Message:
    """One message of an output: where it begins (its ``<|start|>``, or where the one before it ended), where its body
    begins (-1: its header is not whole) and ends, where the message ends (past its end tag), its header's channel and
    recipient, and whether it ended (an end tag, or the next message's header; else the text ended inside it)."""

    start: int
    body_start: int
    body_end: int
    end: int
    channel: str | None
    recipient: str | None
    closed: bool

    @property
    def kind(self) -> str:
        """:data:`FUNCTION_CALL` (a function's recipient), :data:`REASONING` (the analysis channel, or a recipient that
        is no function: a built-in tool's) or :data:`CONTENT` (the rest: final, preambles, a message of no channel)."""
        if self.recipient is not None:
            return FUNCTION_CALL if self.function else REASONING
        return REASONING if self.channel == ANALYSIS else CONTENT

    @property
    def function(self) -> str | None:
        """The function a call message is to (its recipient less ``functions.``), or None."""
        recipient = self.recipient or ""
        if not recipient.startswith(FUNCTIONS):
            return None
        return recipient[len(FUNCTIONS) :] or None


def _held(text: str, start: int, tags: Sequence[str]) -> int:
    """The length of the longest end of ``text[start:]`` that begins one of ``tags`` (and is shorter)."""
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text) - start), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


def _body(text: str, at: int, final: bool) -> tuple[int, int, bool]:
    """A body from ``at``: where it ends, where its message ends, and whether it ended (else the text ended first;
    before the output is final, a tail that may begin a tag is not yet the body's)."""
    found = _BODY_END.search(text, at)
    if found is None:
        end = len(text) if final else len(text) - _held(text, at, (*_CLOSERS, *_OPENERS))
        return end, end, False
    end = found.end() if found.group() in _CLOSERS else found.start()  # (an opener is the next message's)
    return found.start(), end, True


def _lead(text: str, pos: int) -> int:
    """Where the text from ``pos`` on stops being blank."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def messages(text: str, opened: bool = False, final: bool = True) -> list[Message]:
    """The messages of an output (``text``: the output so far; ``final``: the whole of it). ``opened``: the prompt
    ended inside an analysis message's body (``<|channel|>analysis<|message|>``), so the output begins in it. Text
    that does not begin like a header (an output with no harmony at all, or after a prompt that opened the final
    message) is the body of a message of no channel; before the output is final, text that may still begin one
    (``<|``, ``to``) waits. A header the output ended inside has no body (``body_start`` -1)."""
    out: list[Message] = []
    pos = 0
    if opened:
        body_end, end, closed = _body(text, 0, final)
        out.append(Message(0, 0, body_end, end, ANALYSIS, None, closed))
        pos = end if closed else len(text)
    while pos < len(text):
        at = _lead(text, pos)
        lead = text[at : at + max(map(len, _HEADER_OPENINGS))]
        if at == len(text) or (not final and any(o.startswith(lead) and o != lead for o in _HEADER_OPENINGS)):
            break  # blanks, or a header's opening being written
        if not lead.startswith(_HEADER_OPENINGS):  # (text of no header: a body of no channel)
            body_end, end, closed = _body(text, pos, final)
            out.append(Message(pos, pos, body_end, end, None, None, closed))
            if not closed:
                break
            pos = end
            continue
        head = at + len(START) if text.startswith(START, at) else at
        found = _HEADER_END.search(text, head)
        header = text[head : found.start() if found else len(text)]
        channel_found, recipient_found = _CHANNEL.search(header), _RECIPIENT.search(header)
        channel = channel_found.group(1) if channel_found else None
        recipient = recipient_found.group(1) if recipient_found else None
        if found is None:  # (the text ends inside the header)
            if final:
                out.append(Message(pos, -1, len(text), len(text), channel, recipient, False))
            break
        if found.group() == START:  # (a header left unended: the next message begins)
            pos = found.start()
            continue
        if found.group() != MESSAGE:  # (a message with no body)
            out.append(Message(pos, -1, found.start(), found.end(), channel, recipient, True))
            pos = found.end()
            continue
        body_end, end, closed = _body(text, found.end(), final)
        out.append(Message(pos, found.end(), body_end, end, channel, recipient, closed))
        if not closed:
            break
        pos = end
    return out


def call_markup(function: str, body: str, closed: bool) -> str:
    """A call message as the answer holds it: :data:`CALL_TAG`, the function's name, ``<|message|>``, its body (the
    arguments), and ``<|call|>`` once the message ended."""
    return f"{CALL_TAG}{function}{MESSAGE}{body}{CALL if closed else ''}"


@dataclass(frozen=True)
class Reading:
    """An output told apart: its reasoning (the reasoning messages' bodies, each non-empty one a line apart), whether
    it had any, its answer (the content messages' bodies, each non-empty one a line apart, and, when calls are read,
    each call message's :func:`call_markup`, in their order), where the answer's stretches lie in the output,
    whether the output ended inside a reasoning message, and whether its answer's first text came before its
    reasoning's (a preamble, then analysis)."""

    reasoning: str
    seen: bool
    answer: str
    stretches: list[Stretch] = field(default_factory=list)
    in_reasoning: bool = False
    answer_first: bool = False


def read(text: str, opened: bool = False, final: bool = True, calls: bool = False) -> Reading:
    """:class:`Reading` of an output (as :func:`messages` reads it); ``calls``: the answer keeps the calls (it is read
    for tool calls), else they are left out, as vLLM leaves them out without its tool parser."""
    thoughts: list[str] = []
    answer: list[str] = []
    stretches: list[Stretch] = []
    seen, length, said, first = False, 0, False, None
    found = messages(text, opened, final)
    for message in found:
        if message.body_start < 0:
            continue
        body = text[message.body_start : message.body_end]
        kind = message.kind
        if first is None and kind != FUNCTION_CALL and body.strip():
            first = kind
        if kind == REASONING:
            seen = True
            if body:
                thoughts.append(body)
        elif kind == CONTENT:
            if not body:
                continue
            if said:
                answer.append(SEPARATOR)
                length += len(SEPARATOR)
            said = True
            stretches.append((length, message.body_start, len(body)))
            answer.append(body)
            length += len(body)
        elif calls:
            assert message.function is not None
            piece = call_markup(message.function, body, message.closed)
            answer.append(piece)
            length += len(piece)
    last = found[-1] if found else None
    in_reasoning = last is not None and last.kind == REASONING and not last.closed and last.body_start >= 0
    answer_first = first == CONTENT
    return Reading(SEPARATOR.join(thoughts), seen, "".join(answer), stretches, in_reasoning, answer_first)


def reasoning_tokens(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], opened: bool) -> int:
    """How many of an output's tokens belong to its reasoning messages, headers and end tags included. Each token is
    decoded alone: the tags are special tokens of their own and the headers' words whole tokens, so the messages
    fall where they do in the output's text, and each token is counted in the message it begins in (the output's
    last message holds a token with no text of its own, an end-of-sequence one)."""
    texts: dict[int, str] = {}
    starts, length = [], 0
    for token_id in token_ids:
        if token_id not in texts:
            texts[token_id] = decode([token_id])
        starts.append(length)
        length += len(texts[token_id])
    proxy = "".join(texts[t] for t in token_ids)
    found = messages(proxy, opened, final=True)
    spans = [(m.start, m.end if i < len(found) - 1 else length + 1) for i, m in enumerate(found) if m.kind == REASONING]
    return sum(1 for start in starts if any(a <= start < b for a, b in spans))


def opened_in(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` opened an analysis message's body (the output begins in it)."""
    return prompt_tail.rstrip().endswith(f"{CHANNEL}{ANALYSIS}{MESSAGE}")


def answered_in(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` opened the final message's body (the output is all answer): its
    header, ``<|channel|>final`` with perhaps `` <|constrain|>json`` after it, closed by ``<|message|>``."""
    tail = prompt_tail.rstrip()
    if not tail.endswith(MESSAGE):
        return False
    header = tail[: -len(MESSAGE)]
    opened = header.rfind(f"{CHANNEL}final")
    return opened >= 0 and all(tag not in header[opened + len(CHANNEL) :] for tag in (START, CHANNEL, MESSAGE, END))


# -- calls in an answer ------------------------------------------------------------------------------------------------


def marked_call(text: str, at: int) -> tuple[int, str, str, bool] | None:
    """The call whose :func:`call_markup` begins at ``at`` (its :data:`CALL_TAG`): where it ends, the function, its
    arguments (the body as written; ``{}`` for an empty one) and whether it ended; None when its name is not whole."""
    head = at + len(CALL_TAG)
    message = text.find(MESSAGE, head)
    if message < 0:
        return None
    body = message + len(MESSAGE)
    close = text.find(CALL, body)
    end = close if close >= 0 else len(text)
    return (end + len(CALL) if close >= 0 else end), text[head:message], text[body:end] or "{}", close >= 0


def open_call(text: str) -> bool:
    """Whether an answer ends inside a call (its last :func:`call_markup` without ``<|call|>``)."""
    at = text.rfind(CALL_TAG)
    return at >= 0 and CALL not in text[at:]


@dataclass
class HarmonyCallScanner:
    """A call of an answer, from its :data:`CALL_TAG`'s end (``start``), read as the text grows with
    :class:`~boundless.api.call_scanner.CallScanner`'s face (``calls``, ``done``, ``pos``): the call, once its name is
    whole, its arguments the message's body as it grows (whatever it holds: the recipient made it a call), ending at
    ``<|call|>``."""

    start: int
    calls: list[CallSpan] = field(default_factory=list)
    done: bool = False
    pos: int = -1

    def feed(self, text: str) -> None:
        if self.done:  # (fed on while no next call is found: its end, and the next call's tag, stay where they are)
            return
        if self.pos < 0:
            self.pos = self.start
        if not self.calls:
            message = text.find(MESSAGE, self.start)
            if message < 0:
                return
            # (args_opener "" : a body may begin with anything, and a stream sends it as it comes)
            self.calls.append(CallSpan(text[self.start : message], message + len(MESSAGE), None, ""))
        call = self.calls[0]
        assert call.args_start is not None
        close = text.find(CALL, max(self.pos, call.args_start))
        if close < 0:
            self.pos = len(text)
            return
        call.args_end, self.pos, self.done = close, close + len(CALL), True


# -- the prompt --------------------------------------------------------------------------------------------------------

_REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")  # (a turn's reasoning under any of its names)


def harmony_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as gpt-oss's chat template takes them: an assistant turn that made calls writes one analysis
    message before them, its reasoning (``thinking``, which the route gives it under every name) or else its content,
    and the template refuses a turn with both. Such a turn keeps its reasoning (the chain of thought the calls came
    from, which the model reads on from), its content (a preamble the user saw) dropped: this server's own answers are
    such turns when a preamble came before the calls, sent back by a client or chained by the Responses API. vLLM,
    which renders harmony itself, writes both. The messages given are not changed."""
    out = []
    for message in messages:
        reasoned = any(isinstance(message.get(k), str) and message[k] for k in _REASONING_KEYS)
        if message.get("role") == "assistant" and message.get("tool_calls") and message.get("content") and reasoned:
            message = {**message, "content": None}
        out.append(message)
    return out
