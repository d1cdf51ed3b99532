"""The garbage collector's settings for a simulation run.

A cluster's simulation holds millions of long-lived objects (the block pools' blocks, the engines, the programs),
and allocates a few per forward pass, most of them short-lived. Python's collector, left at its defaults, walks
the young objects every 700 allocations and the whole heap whenever the survivors grow by a quarter: at 1,152
instances that was 15-35% of a run's CPU time (docs/simulation.md, Speed). Around a run, the objects built before
it (the engines) are frozen out of the collector's walks and the young generation is collected less often. Nothing
a run computes depends on when the collector runs (no finalizers or weak references decide anything), so the
results are the same to the bit.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Allocations between young collections (CPython's default: 700), and the middle and old generations' counts.
RUN_THRESHOLDS = (100_000, 20, 10)


@contextmanager
def quiet_collector(thresholds: tuple[int, int, int] = RUN_THRESHOLDS) -> Iterator[None]:
    """Freeze what exists now out of the collector's walks and collect less often, until the block ends."""
    before = gc.get_threshold()
    gc.freeze()  # (without a collection first: the little garbage frozen with it is freed at the end, unfrozen)
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
