"""How well the attention-time model fits this machine's real prefill steps.

Runs SmolLM2-135M (the bundled model) on the CPU over a grid of prefill shapes (cached context x new
tokens x requests per step), records each step's shapes and measured seconds as the engine would
(``shapes_of`` + ``StepResult.elapsed_s``), fits ``AttentionTimeModel`` on half the grid (a
checkerboard over context and length) and prints predicted against measured time on the other half.

    flock /tmp/bench.lock python scripts/attention_time_fit.py
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics

import torch

from boundless.engine.attention_time import AttentionSample, AttentionTimeModel, fit_attention_time, shapes_of
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import load_model

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def drain(engine: EngineCore) -> None:
    while engine.has_unfinished():
        engine.step()


def measure(
    engine: EngineCore, prefix: list[int], new: int, k: int, rng: random.Random, ids: itertools.count
) -> AttentionSample:
    """One prefill step of ``k`` requests, each ``new`` tokens over ``prefix`` (in the prefix cache)."""
    vocab = engine.identity.vocab_size
    for _ in range(k):
        engine.add_request(f"r{next(ids)}", prefix + [rng.randrange(1000, vocab) for _ in range(new)], ONE_TOKEN)
    sched = engine.schedule()
    result = engine.execute(sched)
    engine.finish_step(sched, result)
    drain(engine)
    return AttentionSample(shapes_of(sched), result.elapsed_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="steps per grid point (the median is kept)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = engine_config("smollm2-135m", max_num_batched_tokens=8192, max_num_seqs=8, num_kv_blocks=2048)
    engine = EngineCore.from_model(load_model("smollm2-135m"), config)
    rng, ids = random.Random(0), itertools.count()
    contexts, news = (0, 1024, 3072), (32, 256, 768)
    prefixes = {c: [rng.randrange(1000, engine.identity.vocab_size) for _ in range(c)] for c in contexts}
    for c, prefix in prefixes.items():
        if c:  # computed once: its full blocks stay in the prefix cache for every point over it
            engine.add_request(f"prime{c}", prefix, ONE_TOKEN)
            drain(engine)
    measure(engine, [], 64, 1, rng, ids)  # warm-up
    train, test = [], []
    for (ci, c), (ni, n), k in itertools.product(enumerate(contexts), enumerate(news), (1, 2)):
        runs = [measure(engine, prefixes[c], n, k, rng, ids) for _ in range(args.repeats)]
        median = statistics.median(r.seconds for r in runs)
        # A checkerboard over (context, new tokens): each side has every context, length and batch size.
        (test if (ci + ni) % 2 else train).append(((c, n, k), AttentionSample(runs[0].shapes, median)))
        print(f"cached {c:5d} new {n:4d} x{k}: {median * 1000:8.1f} ms  shapes {runs[0].shapes}", flush=True)
    model: AttentionTimeModel = fit_attention_time(s for _, s in train)
    print(
        f"\nfit on {len(train)} points: base {model.base_s * 1e3:.2f} ms, {model.per_seq_s * 1e3:.2f} ms/request, "
        f"{model.per_token_s * 1e6:.1f} us/token, "
        f"{model.per_pair_s * 1e9:.2f} ns/pair"
    )
    print("\n| cached | new | requests | measured ms | predicted ms | error |\n|---:|---:|---:|---:|---:|---:|")
    errors = []
    for (c, n, k), s in test:
        predicted = model.predict(s.shapes)
        errors.append(abs(predicted - s.seconds) / s.seconds)
        print(f"| {c} | {n} | {k} | {s.seconds * 1e3:.1f} | {predicted * 1e3:.1f} | {errors[-1]:.1%} |")
    print(f"\nheld-out points: median error {statistics.median(errors):.1%}, max {max(errors):.1%}")


if __name__ == "__main__":
    main()
