"""A reasoning model's thinking, told apart from its answer (vLLM's ``--reasoning-parser``).

Reasoning models (DeepSeek-R1, Qwen3, QwQ) write their thinking between ``<think>`` and ``</think>`` before the
answer. With a parser, the chat route returns the thinking as the message's ``reasoning`` (vLLM's name; also
``reasoning_content``, DeepSeek's and vLLM's older one) and the rest as its ``content``, which alone is read for
tool calls; the Responses API returns it as a ``reasoning`` item.

Where the output starts matters: DeepSeek-R1's chat template opens the think block in the prompt, so its output
starts inside it and may never write ``<think>``; Qwen3's hybrid models write ``<think>`` themselves, or nothing at
all when the request turned thinking off (``chat_template_kwargs: {"enable_thinking": false}``: the template then
closes an empty block in the prompt); Qwen3's thinking-only models open it in the prompt as R1 does. So ``qwen3``
starts inside the reasoning when the prompt ends with ``<think>`` or the output begins with it, and ``deepseek_r1``
always does. Output cut off before ``</think>`` is all reasoning.

Mistral's reasoning models (Magistral; vLLM's ``mistral`` parser) write ``[THINK]...[/THINK]`` instead, of their own
accord: an output that opens with ``[THINK]`` reasons, one that does not is all answer. Those tags are special tokens,
which decoded text leaves out by default, so under that parser outputs keep their special tokens
(:attr:`ReasoningParser.special_tags`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from boundless.api.tool_calls import partial_tag

REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral")


@dataclass(frozen=True)
class Split:
    """An output's reasoning (None when it has none) and its answer (None when empty)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningParser:
    """How a model marks its reasoning: between ``start`` and ``end``. ``always_opens``: the output starts inside the
    reasoning unless the prompt closed it (DeepSeek-R1's template opens it); else only when the prompt ends with
    ``start`` or the output begins with it. ``opened`` below: :meth:`opens_in_reasoning` of the output's prompt.
    ``special_tags``: the tags are special tokens (Mistral's), so outputs are decoded with their special tokens."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_opens: bool = False
    special_tags: bool = False

    @classmethod
    def named(cls, name: str) -> ReasoningParser:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(REASONING_PARSERS)}")
        if name == "mistral":
            return cls(name, "[THINK]", "[/THINK]", special_tags=True)
        return cls(name, always_opens=name == "deepseek_r1")

    def opens_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether an output of a prompt ending with ``prompt_tail`` starts inside the reasoning: not when the prompt
        closed it (thinking turned off), else always for a model whose template opens it, else when the prompt
        opened it."""
        if self.closed_in(prompt_tail):
            return False
        return self.always_opens or prompt_tail.rstrip().endswith(self.start)

    def closed_in(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with ``prompt_tail`` closed the thinking (Qwen3's ``enable_thinking: false``)."""
        return prompt_tail.rstrip().endswith(self.end)

    def split(self, text: str, opened: bool) -> Split:
        """A finished output's reasoning and answer (``opened``: :meth:`opens_in_reasoning` of its prompt)."""
        reasoning, content, seen = self.visible(text, opened, final=True)
        return Split(reasoning if seen else None, content or None)

    def visible(self, text: str, opened: bool, final: bool) -> tuple[str, str, bool]:
        """``(reasoning, content, reasoning_seen)`` of ``text``. Before the output is final, what may still be part
        of a tag is held back, so that each is a prefix of what a longer ``text`` gives (a stream sends each once)."""
        lead = text.lstrip()
        if lead.startswith(self.start):
            begin = len(text) - len(lead) + len(self.start)
            opened = True
        elif not final and self.start.startswith(lead):
            return "", "", opened  # blanks, or the start tag being written: not yet known which
        elif not opened:
            return "", text, False
        else:
            begin = 0
        end = text.find(self.end, begin)
        if end >= 0:
            return text[begin:end], text[end + len(self.end) :], True
        body = text[begin:]
        if not final:
            body = body[: len(body) - partial_tag(body, self.end)]
        return body, "", True


class ReasoningStream:
    """One streamed output's reasoning and answer, each new piece once: :meth:`feed` the whole text so far."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.opened = opened
        self.reasoning = ""  # sent so far
        self.content = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the answer that ``text`` adds to what was sent; ``final`` once the output ended."""
        reasoning, content, _ = self.parser.visible(text, self.opened, final)
        new_reasoning, new_content = reasoning[len(self.reasoning) :], content[len(self.content) :]
        self.reasoning, self.content = reasoning, content
        return new_reasoning, new_content


@dataclass(frozen=True)
class ReasoningOutput:
    """How one request's outputs are read: the parser, whether they start inside the reasoning (their prompt opened
    it), and whether the client wants the reasoning returned (vLLM's ``include_reasoning``)."""

    parser: ReasoningParser
    opened: bool
    include: bool = True

    def split(self, text: str) -> Split:
        return self.parser.split(text, self.opened)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.opened)

    @staticmethod
    def fields(reasoning: str | None) -> dict[str, str | None]:
        """A message's reasoning under vLLM's name and under DeepSeek's (vLLM's before 0.11), which clients read."""
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    def tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of an output's tokens are reasoning: up to the one that completes the end tag (all of them when
        the output ended inside the reasoning, none when it had none). Found by bisection over decoded prefixes, so
        a tag of several tokens counts as well as a single one."""
        text = decode(token_ids)
        if self.split(text).reasoning is None:
            return 0
        end = self.parser.end
        if end not in text:
            return len(token_ids)
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if end in decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo
