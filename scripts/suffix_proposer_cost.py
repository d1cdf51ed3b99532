"""The suffix-decoding proposer's cost in Python: microseconds a proposal and a recorded token, and the cache's
memory, over synthetic agent-like token streams (phrases drawn by a power law from a vocabulary of 49,152).

    .venv/bin/python scripts/suffix_proposer_cost.py   # the figures in docs/engine.md's suffix decoding paragraph
"""

from __future__ import annotations

import itertools
import random
import time
import tracemalloc

from boundless.config import SpeculativeConfig
from boundless.engine.suffix_decoding import SuffixProposer

rng = random.Random(0)
PHRASES = [[rng.randrange(49152) for _ in range(rng.randrange(3, 20))] for _ in range(20000)]
CUMULATIVE = list(itertools.accumulate(1 / (i + 1) ** 0.8 for i in range(len(PHRASES))))


def text(n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += rng.choices(PHRASES, cum_weights=CUMULATIVE)[0]
    return out[:n]


def main() -> None:
    for cached in (100, 2000, 10000):
        proposer = SuffixProposer(SpeculativeConfig.parse('{"method": "suffix"}'))
        requests = [(text(200), text(300)) for _ in range(cached)]
        start = time.perf_counter()
        for i, (prompt, output) in enumerate(requests):
            proposer.finish(f"r{i}", prompt + output, len(prompt))
        record_us = (time.perf_counter() - start) / (cached * 300) * 1e6
        for prompt_len in (1000, 8000):
            tokens, extra = text(prompt_len), text(300)
            proposer.propose("x", tokens, prompt_len, 24)
            start, drafted = time.perf_counter(), 0
            for token in extra:
                tokens.append(token)
                drafted += len(proposer.propose("x", tokens, prompt_len, 24))
            propose_us = (time.perf_counter() - start) / len(extra) * 1e6
            print(
                f"{cached:>6} cached outputs of 300 tokens, a {prompt_len}-token prompt: {propose_us:.0f} us a "
                f"proposal ({drafted} tokens proposed over 300), {record_us:.2f} us a recorded token"
            )
            proposer.finish("x", tokens, prompt_len)
    outputs = [text(300) for _ in range(10000)]
    tracemalloc.start()
    proposer = SuffixProposer(SpeculativeConfig.parse('{"method": "suffix"}'))
    for i, output in enumerate(outputs):
        proposer.finish(f"m{i}", [0, *output], 1)
    print(f"memory of 10,000 cached outputs of 300 tokens: {tracemalloc.get_traced_memory()[0] / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
