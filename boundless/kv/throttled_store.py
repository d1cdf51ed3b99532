"""A disk store whose reads wait for an emulated storage link (``cluster/links.py``).

On one machine every instance reads the same disk, so DualPath's bottleneck (the prefill nodes' storage
NICs saturated, the decode nodes' idle) cannot appear by itself. Each instance's store reads therefore wait,
after the real read, until their bytes would have crossed that instance's own storage link: a load is done
when the link has carried it. Probes (``contains``) cost no bandwidth and writes are not limited (the
paper's bottleneck is the reads); the link's queued bytes are the node's read queue the scheduler balances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from boundless.kv.block_hash import BlockHash
from boundless.kv.tiers import BlockStore


class ThrottledStore:
    """``store`` with every read held until ``throttle(nbytes)`` returns (the bytes crossed the link)."""

    def __init__(self, store: BlockStore, throttle: Callable[[int], object]) -> None:
        self.store = store
        self.throttle = throttle

    def contains(self, key: BlockHash) -> bool:
        return self.store.contains(key)

    def read(self, keys: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        blocks = self.store.read(keys)
        nbytes = sum(b.numel() * b.element_size() for b in blocks if b is not None)
        if nbytes:
            self.throttle(nbytes)
        return blocks

    def write(self, keys: Sequence[BlockHash], blocks: torch.Tensor) -> int:
        return self.store.write(keys, blocks)

    def stats(self) -> object:
        return self.store.stats()
