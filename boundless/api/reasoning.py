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

GLM-4.5 and GLM-4.6 (vLLM's ``glm45``) think as Qwen3's hybrid models do: their template ends the prompt with
``<|assistant|>`` and the model writes ``<think>`` itself, or, with ``enable_thinking: false``, the template closes an
empty ``<think></think>`` in the prompt; so ``glm45`` reads an output as ``qwen3`` does (and GLM-4.7's, whose template
opens ``<think>`` in the prompt). vLLM's ``glm45`` now takes an output that does not open with ``<think>`` as
reasoning unless the request turned thinking off (its template variables); here it is the answer, as vLLM's first
``glm45`` parser read it: a model that skips its thinking answers in plain text.

Mistral's reasoning models (Magistral; vLLM's ``mistral`` parser) write ``[THINK]...[/THINK]`` instead, of their own
accord: an output that opens with ``[THINK]`` reasons, one that does not is all answer. Those tags are special tokens,
which decoded text leaves out by default, so under that parser outputs keep their special tokens
(:attr:`ReasoningParser.special_tags`).

gpt-oss (vLLM's ``openai_gptoss``) writes OpenAI's harmony messages instead (``api/harmony.py``): its reasoning is its
``analysis`` messages, wherever they fall, and its answer its ``final`` messages and preambles, with its function
calls kept in it for ``tool_calls`` to read when the request's output is read for them
(:class:`HarmonyReasoningParser`). A model whose vocabulary is harmony's, or ``--tool-call-parser openai``, which
reads those calls, reads the output so even without this flag, as vLLM reads every gpt-oss output
(:func:`reasoning_parser_name`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from boundless.api import harmony
from boundless.api.logprobs import Stretch
from boundless.api.tool_calls import partial_tag

REASONING_PARSERS = ("deepseek_r1", "qwen3", "glm45", "mistral", "openai_gptoss")
HARMONY_PARSER = "openai_gptoss"
HARMONY_CALLS = "openai"  # (the --tool-call-parser that reads harmony's calls)


# Harmony's tags, each a special token of gpt-oss's vocabulary (o200k_harmony): a vocabulary holding them all is one.
HARMONY_TAGS = (harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.END, harmony.RETURN, harmony.CALL)


def reasoning_parser_name(
    reasoning_parser: str | None, tool_call_parser: str | None, tokenizer: Any = None
) -> str | None:
    """The reasoning parser a server reads outputs with: ``--reasoning-parser``'s, else gpt-oss's when
    ``--tool-call-parser openai`` reads its harmony calls (they are among its messages, beside its reasoning) or when
    ``tokenizer``'s vocabulary is harmony's (:data:`HARMONY_TAGS`): vLLM reads every gpt-oss output's messages so,
    with or without a flag, and a harmony output read as plain text is its tags and channels verbatim."""
    if reasoning_parser is not None:
        return reasoning_parser
    harmony_vocabulary = tokenizer is not None and all(tokenizer.token_to_id(t) is not None for t in HARMONY_TAGS)
    return HARMONY_PARSER if tool_call_parser == HARMONY_CALLS or harmony_vocabulary else None


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
        if name == HARMONY_PARSER:
            return HarmonyReasoningParser(name)
        return cls(name, always_opens=name == "deepseek_r1")

    def with_calls(self, read: bool) -> ReasoningParser:
        """The parser for one request's outputs, whose answer is read for tool calls (``read``) or not: the same,
        but for harmony's, whose answer keeps its calls only when they are read."""
        return self

    @property
    def answer_after(self) -> str:
        """The tag after which the answer begins: a grammar of the answer begins after it (and after
        :attr:`answer_close` when there is one)."""
        return self.end

    @property
    def answer_close(self) -> str:
        """The tag that closes the header :attr:`answer_after` opens, a few tokens on (``StructuredOutput
        .after_close``); empty: the answer begins right after :attr:`answer_after`."""
        return ""

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

    def stretches(self, text: str, opened: bool, final: bool) -> list[Stretch] | None:
        """Where :meth:`visible`'s answer lies in ``text``, stretch by stretch (``logprobs.Stretch``); None when it is
        the text's end (every parser's but harmony's, whose answer gathers messages from all over the output)."""
        return None

    def ends_in_reasoning(self, text: str, opened: bool) -> bool:
        """Whether a finished output that had reasoning ended inside it (cut off before the end tag)."""
        return self.end not in text

    @property
    def interleaves(self) -> bool:
        """Whether reasoning may come after the answer began (harmony's analysis after a preamble); else the
        reasoning is whole once the answer begins."""
        return False

    def answers_first(self, text: str, opened: bool) -> bool:
        """Whether a finished output's answer began before its reasoning (never, but for harmony's)."""
        return False

    def reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], opened: bool) -> int:
        """How many of an output's tokens are reasoning: up to the one that completes the end tag (all of them when
        the output ended inside the reasoning, none when it had none). Found by bisection over decoded prefixes, so
        a tag of several tokens counts as well as a single one."""
        text = decode(token_ids)
        if self.split(text, opened).reasoning is None:
            return 0
        if self.end not in text:
            return len(token_ids)
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.end in decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo


@dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (``api/harmony.py``): the reasoning is the ``analysis`` messages' bodies, the answer
    the ``final`` messages' and preambles', and, with ``calls`` (:meth:`with_calls`), the function calls in the form
    ``tool_calls`` reads. The tags are special tokens. ``start`` and ``end`` are an analysis message's opening and end
    tag, which a thinking budget forces (the model then goes on to its answer or a call); an answer's grammar begins
    after the final message's header (:attr:`answer_after` to :attr:`answer_close`, whatever it holds between, as
    vLLM's parser ends the reasoning there). A prompt
    that opened an analysis message's body starts the output inside the reasoning; one that opened the final
    message's closed it."""

    start: str = f"{harmony.CHANNEL}{harmony.ANALYSIS}{harmony.MESSAGE}"
    end: str = harmony.END
    special_tags: bool = True
    calls: bool = False

    def with_calls(self, read: bool) -> ReasoningParser:
        return dataclasses.replace(self, calls=read)

    @property
    def answer_after(self) -> str:
        return f"{harmony.CHANNEL}final"

    @property
    def answer_close(self) -> str:
        # (The final message's header may hold more before its body: `` <|constrain|>json``.)
        return harmony.MESSAGE

    def opens_in_reasoning(self, prompt_tail: str) -> bool:
        return harmony.opened_in(prompt_tail)

    def closed_in(self, prompt_tail: str) -> bool:
        return harmony.answered_in(prompt_tail)

    def visible(self, text: str, opened: bool, final: bool) -> tuple[str, str, bool]:
        reading = harmony.read(text, opened, final, self.calls)
        return reading.reasoning, reading.answer, reading.seen

    def stretches(self, text: str, opened: bool, final: bool) -> list[Stretch] | None:
        return harmony.read(text, opened, final, self.calls).stretches

    def ends_in_reasoning(self, text: str, opened: bool) -> bool:
        return harmony.read(text, opened).in_reasoning

    @property
    def interleaves(self) -> bool:
        return True

    def answers_first(self, text: str, opened: bool) -> bool:
        return harmony.read(text, opened).answer_first

    def reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], opened: bool) -> int:
        return harmony.reasoning_tokens(token_ids, decode, opened)


class ReasoningStream:
    """One streamed output's reasoning and answer, each new piece once: :meth:`feed` the whole text so far."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.opened = opened
        self.reasoning = ""  # sent so far
        self.content = ""
        self._text, self._final = "", False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the answer that ``text`` adds to what was sent; ``final`` once the output ended."""
        reasoning, content, _ = self.parser.visible(text, self.opened, final)
        new_reasoning, new_content = reasoning[len(self.reasoning) :], content[len(self.content) :]
        self.reasoning, self.content = reasoning, content
        self._text, self._final = text, final
        return new_reasoning, new_content

    @property
    def stretches(self) -> list[Stretch] | None:
        """Where the answer so far (:attr:`content`) lies in the text last fed (:meth:`ReasoningParser.stretches`)."""
        return self.parser.stretches(self._text, self.opened, self._final)


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

    def stretches(self, text: str) -> list[Stretch] | None:
        """Where a finished output's answer lies in it (:meth:`ReasoningParser.stretches`)."""
        return self.parser.stretches(text, self.opened, final=True)

    def ended_in_reasoning(self, text: str) -> bool:
        """Whether a finished output ended inside its reasoning (:meth:`ReasoningParser.ends_in_reasoning`)."""
        return self.parser.ends_in_reasoning(text, self.opened)

    def answers_first(self, text: str) -> bool:
        """Whether a finished output's answer began before its reasoning (:meth:`ReasoningParser.answers_first`)."""
        return self.parser.answers_first(text, self.opened)

    def tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of an output's tokens are reasoning (:meth:`ReasoningParser.reasoning_tokens`; ``decode``: the
        tokenizer's, special tokens kept)."""
        return self.parser.reasoning_tokens(token_ids, decode, self.opened)
