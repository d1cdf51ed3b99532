"""The long-context benchmark's trace: many short requests and a few whose context exceeds one instance's KV pool.

The shape of Infinite-LLM's mixed traces (request lengths spread over orders of magnitude), scaled to a CPU:
short requests of tens to a couple hundred tokens, and a few long ones whose prompts are given as multiples of
one instance's pool (0.75x fits one instance, 2.5x needs three). Arrivals are Poisson at ``rate`` per second (0:
all at once), drawn apart from the lengths, so every setup serves the very same requests at the very same times.
The first requests are short, so the engines have run steps of a few shapes before a long one arrives (the
lending planner fits its performance model to them); the long ones come spread evenly over the rest.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: its prompt, how many tokens it generates, and when it arrives (seconds)."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    long: bool

    @property
    def context(self) -> int:
        """The tokens its KV holds at the end: prompt and output."""
        return len(self.prompt) + self.max_tokens


@dataclass(frozen=True)
class TraceShape:
    """Lengths of the trace's requests, in tokens; long prompts as multiples of one instance's pool."""

    num_short: int = 30
    short_prompt: tuple[int, int] = (32, 192)
    short_output: tuple[int, int] = (8, 32)
    long_factors: tuple[float, ...] = (0.75, 1.5, 2.5)
    long_output: int = 16
    short_first: int = 6  # requests at the head of the trace that are short


def make_trace(shape: TraceShape, pool_tokens: int, vocab_size: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """The trace (see the module): the same lengths, tokens and order for a seed, arrivals by ``rate``."""
    rng = random.Random(f"longctx:{seed}")
    num_long = len(shape.long_factors)
    first = min(shape.short_first, shape.num_short)  # (fewer short requests than the head: all of them lead)
    tail = shape.num_short + num_long - first
    # The long requests spread evenly over the rest, in the given order: rare, as in the paper's traces. (The tail
    # holds them all, so no two fall on one place.)
    at = {first + (2 * i + 1) * tail // (2 * num_long) for i in range(num_long)}
    kinds = [i in at for i in range(shape.num_short + num_long)]
    longs = iter(shape.long_factors)
    out: list[TraceRequest] = []
    arrivals = random.Random(f"longctx-arrivals:{seed}")
    t = 0.0
    for i, is_long in enumerate(kinds):
        if is_long:
            n, new = max(1, int(next(longs) * pool_tokens)), shape.long_output
        else:
            n, new = rng.randint(*shape.short_prompt), rng.randint(*shape.short_output)
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(n))
        t += arrivals.expovariate(rate) if rate > 0 else 0.0
        out.append(TraceRequest(f"{'long' if is_long else 'short'}-{i}", prompt, new, t, is_long))
    return out
