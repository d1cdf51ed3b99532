"""What many stop strings and a big logit bias cost the engine's host side, the old way against the one in use, in
one run: a token's stop check over 400,000 strings (a ``str.find`` each, against ``StopStrings``'s lookups by
length), and a sampling step of 128 rows under a whole vocabulary's ``logit_bias`` (the bias rebuilt from Python
lists each step, against ``Sampler``'s tensors made once for the rows that share it). Usage::

    python scripts/sampling_host_costs.py
"""

from __future__ import annotations

import time

import torch

from boundless.engine.sampler import Sampler
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk
from boundless.engine.stop_strings import StopStrings


def per_call(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def stop_check() -> None:
    stops = tuple(f"zq{i}" for i in range(400_000))
    text = "Once upon a time there was a little girl named Lily who loved to play outside in the park. "
    before = len(text) - 4
    longest = max(map(len, stops))

    def find_each() -> None:  # (the detokenizer's loop before)
        start = max(0, before - longest + 1)
        for s in stops:
            text.find(s, start)

    index = StopStrings(stops)
    old, new = per_call(find_each, 3), per_call(lambda: index.first(text, before), 100)
    print(
        f"stop check, 400,000 strings: a find each {old * 1e3:.1f} ms, by length {new * 1e6:.1f} us ({old / new:.0f}x)"
    )


def bias_step() -> None:
    vocab, rows = 49_152, 128
    params = SamplingParams(n=rows, temperature=1.0, logit_bias={i: -1.0 for i in range(vocab)})
    chunks = [
        ScheduledChunk(f"r{i}", [1], 0, [0], True, params.for_sample(i), 0, eos_token_ids=(2,)) for i in range(rows)
    ]
    logits = torch.zeros(rows, vocab)
    sampler = Sampler(torch.device("cpu"))

    def lists_each_step() -> None:  # (the sampler's bias before: three lists of every row's pairs, each step)
        bias_rows, bias_ids, biases = [], [], []
        for i, c in enumerate(chunks):
            for token, bias in c.sampling_params.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                biases.append(bias)
        out = logits.clone()
        out[torch.tensor(bias_rows), torch.tensor(bias_ids)] += torch.tensor(biases)

    plain = [dataclass_without_bias(c) for c in chunks]
    base = per_call(lambda: sampler.sample(logits, plain), 3)
    new = per_call(lambda: sampler.sample(logits, chunks), 3)
    old = base + per_call(lists_each_step, 3)
    print(
        f"sampling step, {rows} rows, a whole vocabulary's logit_bias: rebuilt each step {old:.2f} s, made once "
        f"{new:.2f} s ({old / new:.1f}x; {base:.2f} s without a bias)"
    )


def dataclass_without_bias(chunk: ScheduledChunk) -> ScheduledChunk:
    import dataclasses

    return dataclasses.replace(chunk, sampling_params=dataclasses.replace(chunk.sampling_params, logit_bias=()))


if __name__ == "__main__":
    stop_check()
    bias_step()
