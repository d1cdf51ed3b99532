"""A disk store whose reads wait for an emulated storage link (``cluster/links.py``).

On one machine every instance reads the same disk, so DualPath's bottleneck (the prefill nodes' storage
NICs saturated, the decode nodes' idle) cannot appear by itself. Each instance's store reads therefore wait,
after the real read, until their bytes would have crossed that instance's own storage link: a load is done
when the link has carried it. Probes (``contains``) cost no bandwidth and writes are not limited (the
paper's bottleneck is the reads); the link's queued bytes are the node's read queue the scheduler balances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from boundless.kv.block_hash import BlockHash
from boundless.kv.tiers import BlockStore


class ReadLink(Protocol):
    """An emulated storage link (``cluster/links.py``'s ``ThrottledLink``): waits until bytes have crossed it."""

    def transfer(self, nbytes: int) -> object: ...

    def transfer_parts(self, sizes: Sequence[int], on_part: Callable[[int], None]) -> object: ...


class ThrottledStore:
    """``store`` with every read held until ``throttle(nbytes)`` returns (the bytes crossed the link).

    A layerwise load (``kv/layer_gate.py``) reads unthrottled (:meth:`read_unpaced`) and then has the link carry
    the bytes in parts (:meth:`carry`), one per layer, with ``throttle_parts`` (``ThrottledLink.transfer_parts``:
    all parts queued at once), else one ``throttle`` call after another.
    """

    def __init__(
        self,
        store: BlockStore,
        throttle: Callable[[int], object],
        throttle_parts: Callable[[Sequence[int], Callable[[int], None]], object] | None = None,
    ) -> None:
        self.store = store
        self.throttle = throttle
        self.throttle_parts = throttle_parts

    def read_unpaced(self, keys: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """The blocks, read at once: their bytes are still to be :meth:`carry` 'd over the link."""
        return self.store.read(keys)

    def carry(self, sizes: Sequence[int], on_part: Callable[[int], None]) -> None:
        """Wait for the link to carry ``sizes`` bytes in order, calling ``on_part(i)`` as part ``i`` has crossed."""
        if self.throttle_parts is not None:
            self.throttle_parts(sizes, on_part)
            return
        for i, nbytes in enumerate(sizes):
            self.throttle(nbytes)
            on_part(i)

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
