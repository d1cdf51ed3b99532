"""A reasoning model's thinking held to a number of tokens (vLLM's ``thinking_token_budget``, Anthropic's
``thinking.budget_tokens``).

A reasoning model that loops in its thinking ("Wait, let me re-read...") spends a request's ``max_tokens`` there and
never answers: an agent gets an empty message. With a budget, once the thinking holds that many tokens the sampler
allows only the thinking's end tag next (its tokens one by one, where it is several), so the model closes its thinking
and answers; the reasoning parser splits the output as it would any other. vLLM, SGLang and llama.cpp force the end
tag the same way. The model may close its thinking sooner on its own; then nothing is forced.

Where the thinking begins: at the output's start when the prompt opened it (a template that writes ``<think>``, or
DeepSeek-R1's), else where the output begins with the start tag (Qwen3 writes it first). An output that begins
otherwise does not think, and is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from boundless.engine.structured_output import grammar_start


@dataclass(frozen=True)
class ThinkingBudget:
    """At most ``tokens`` tokens of thinking, then ``end`` (the end tag's token ids) is forced. ``start``: the start
    tag's ids that the output must begin with for it to think; empty when the prompt opened the thinking."""

    tokens: int
    end: tuple[int, ...]
    start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", tuple(self.end))
        object.__setattr__(self, "start", tuple(self.start))
        if not (isinstance(self.tokens, int) and self.tokens >= 0):
            raise ValueError("a thinking budget is a number of tokens, 0 or more")
        if not self.end:
            raise ValueError("a thinking budget needs the end tag's token ids")

    def within(self, num_outputs: int) -> bool:
        """Whether an output of this many tokens is within the budget: nothing to force yet, whatever the tokens (the
        check of every step, without reading them)."""
        return num_outputs - len(self.start) < self.tokens

    def forced(self, outputs: Sequence[int]) -> int | None:
        """The token that must follow ``outputs`` (a request's output so far) to close its thinking, or None: free
        (not thinking, within the budget, or closed)."""
        begin = len(self.start)
        if self.within(len(outputs)) or (begin and tuple(outputs[:begin]) != self.start) or self.closed(outputs):
            return None
        thought = outputs[begin:]
        # The end tag's first tokens already written at the output's end (forced a step ago, or the model's own).
        end = self.end
        written = next(k for k in range(min(len(end) - 1, len(thought)), -1, -1) if _ends_with(thought, end[:k]))
        return end[written]

    def closed(self, outputs: Sequence[int]) -> bool:
        """Whether the output has closed its thinking (the end tag after the thinking's start), or never opened it."""
        begin = len(self.start)
        if begin and tuple(outputs[:begin]) != self.start:
            return len(outputs) >= begin  # (shorter: it may still be writing the start tag)
        return grammar_start(outputs[begin:], self.end) is not None


def _ends_with(tokens: Sequence[int], suffix: Sequence[int]) -> bool:
    return not suffix or tuple(tokens[len(tokens) - len(suffix) :]) == tuple(suffix)
