"""The garbage collector's settings for a run of the engine: offline generation, and a simulation.

Python's collector walks every object it tracks in each full collection: after start-up that is the imported modules'
objects, the model's and the engines'. During ``LLM.generate`` a decode run of 256 requests on a tiny model spent ~10%
of its wall time in such walks (docs/engine.md), and where a full collection fell moved with any change in how much a
step allocates. :func:`frozen_heap` keeps what exists when a run starts out of them; the collector still collects what
the run allocates.

A cluster's simulation (:func:`quiet_collector`) holds millions of long-lived objects (the block pools' blocks, the
engines, the programs), and allocates a few per forward pass, most of them freed at once by their reference counts.
Python's collector exists for the rest, the garbage in reference cycles; but a run makes none: a full collection after
a run with the collector off found no unreachable object, in the light 1,152-instance chat run, an 8P16D
prefill/decode run with host and disk tiers, a KV-lending longctx run and a run with a hung instance
(docs/simulation.md, Speed). Left on, the collector walks what each young generation kept alive (the calls' token
lists among it, element by element), at its defaults every 700 allocations and the whole heap whenever the survivors
grow by a quarter: at 1,152 instances that was 15-35% of a run's CPU time at the defaults, and still a part with young
collections every 100,000 allocations. So it is off for a run, and the objects built before it (the engines) are
frozen out of its walks; both are restored when the run ends (the collector, on again, reclaims anything a rarer path
left). Nothing a run computes depends on when the collector runs (no finalizers or weak references decide anything),
so the results are the same to the bit.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_collector() -> Iterator[None]:
    """Freeze what exists now out of the collector's walks and switch it off, until the block ends."""
    enabled = gc.isenabled()
    gc.freeze()  # (without a collection first: the little garbage frozen with it is freed at the end, unfrozen)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects that exist now out of the collector's walks until the block ends (it still collects what the
    block allocates; garbage frozen with them is collected once they are unfrozen). Nothing, where objects are frozen
    already (``boundless serve``'s start-up heap, a caller's own freeze): unfreezing at the end would undo that."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
