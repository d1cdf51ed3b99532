"""The calibration grid: batch shapes run on a bare engine to the end, and its steps taken per shape.

``simulate calibrate`` fits a profile on the steps of a grid (``sim/calibrate.py``); a bare grid steps an
``EngineCore`` in a loop, a served one goes through the HTTP server (``sim/served_grid.py``).
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from boundless.engine.attention_time import AttentionSample, ChunkShape
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class CalibrationGrid:
    """The batch shapes to run: every number of requests with every prompt length, ``output_tokens`` each,
    the whole grid ``repeats`` times."""

    # 3 and 6 beside the powers of two: the matmul micro-kernel's 4-row groups make a decode of 6 cost as much as
    # one of 8 (sim/step_model.py), which a grid of 1, 2, 4, 8 cannot show.
    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    prompt_lens: tuple[int, ...] = (16, 128, 512, 1024)
    output_tokens: int = 8
    repeats: int = 2
    # Served grids only: a cell's requests start this many seconds apart (0: all together), their prompts
    # ``shared_prefix`` tokens in common, then ``prompt_len`` of their own: the programs' calls, a short prompt
    # appended to a cached prefix while the cell's earlier requests decode.
    arrival_gap_s: float = 0.0
    shared_prefix: int = 0


def run_grid(core: EngineCore, grid: CalibrationGrid, seed: int = 0) -> list[AttentionSample]:
    """Run every shape of ``grid`` on ``core`` to the end, ``grid.repeats`` times; the steps it recorded.

    Prompt lengths, not contents, decide the scheduler's steps, so every repeat runs the same step shapes."""
    rng = random.Random(seed)
    vocab = core.identity.vocab_size
    ids = itertools.count()
    params = SamplingParams(max_tokens=grid.output_tokens, ignore_eos=True)
    core.step_times.drain()
    samples: list[AttentionSample] = []
    for _, batch, prompt_len in itertools.product(range(grid.repeats), grid.batch_sizes, grid.prompt_lens):
        for _ in range(batch):  # random prompts: no prefix-cache hits between them
            core.add_request(f"cal{next(ids)}", [rng.randrange(100, vocab) for _ in range(prompt_len)], params)
        while core.has_unfinished():
            core.step()
        samples += core.step_times.drain()
        core.reset_prefix_cache()
    return samples


def step_shape(sample: AttentionSample) -> tuple[ChunkShape, ...]:
    """A step's chunk shapes in a fixed order: the same batch in another order costs the same."""
    return tuple(sorted(sample.shapes, key=lambda c: (c.cached, c.new)))


def fastest_per_shape(samples: Sequence[AttentionSample]) -> list[AttentionSample]:
    """Each distinct step shape once, with its fastest measured time (in first-seen order).

    Contention only adds time, so the minimum over repeats is the closest to what the shape itself costs."""
    best: dict[tuple[ChunkShape, ...], float] = {}
    for s in samples:
        shape = step_shape(s)
        best[shape] = min(best.get(shape, s.seconds), s.seconds)
    return [AttentionSample(shapes, seconds) for shapes, seconds in best.items()]


def median_per_shape(samples: Sequence[AttentionSample]) -> list[AttentionSample]:
    """Each distinct step shape once, with the median of its measured times (in first-seen order).

    For a served engine: what serving adds to a step is there in every pass, a burst of outside load in one."""
    times: dict[tuple[ChunkShape, ...], list[float]] = {}
    for s in samples:
        times.setdefault(step_shape(s), []).append(s.seconds)
    return [AttentionSample(shapes, statistics.median(seconds)) for shapes, seconds in times.items()]


# Run before a grid that is timed: an engine's first calls allocate and compile.
WARM_UP_GRID = CalibrationGrid((1,), (32,), output_tokens=2, repeats=1)
