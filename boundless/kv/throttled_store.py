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
        begin: Callable[[int], Callable[[], object]] | None = None,
        announce: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.throttle = throttle
        self.throttle_parts = throttle_parts
        self.begin = begin
        self._announce = announce
        # A store that reads into a given buffer (the engine's loader then skips a fresh tensor per block and a
        # stack): offered only then, so the loader's choice of path follows the store behind.
        if hasattr(store, "read_into"):
            self.read_into = self._read_into
        # The store's optional listing, for the same reason (``tiers.BlockStore``): a restarted engine loads the
        # names it held at open without probing for them first.
        if hasattr(store, "held_keys"):
            self.held_keys = store.held_keys
        # And its start-up line (the engine logs its store's ``describe``, else the raw stats).
        if hasattr(store, "describe"):
            self.describe = lambda: f"{store.describe()}; read over an emulated storage link"

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

    def announce(self, nbytes: int) -> None:
        """A read of ``nbytes`` queued at the loader (negative: started or dropped): the link counts it as queued
        (``ThrottledLink.announce``), so the node's read queue shows the loader's backlog."""
        if self._announce is not None:
            self._announce(nbytes)

    def _read_into(self, keys: Sequence[BlockHash], out: torch.Tensor) -> list[bool]:
        """The store's ``read_into``, its bytes carried by the link. With ``begin`` the bytes of every key are queued
        on the link before the files are read, so reading and checking them overlaps the link's carrying them (the
        read takes the longer of the two, not their sum); the loader asks only for blocks a probe found, so a block
        that then fails its check (rare: counted by the store) is the only one carried for nothing. Without
        ``begin``, as :meth:`read`: the blocks that came back, carried after the read."""
        block_bytes = out[0].numel() * out.element_size() if len(keys) else 0
        wait = self.begin(block_bytes * len(keys)) if self.begin is not None and keys else None
        ok = self.store.read_into(keys, out)  # type: ignore[attr-defined]
        if wait is not None:
            wait()
        elif nbytes := block_bytes * sum(ok):
            self.throttle(nbytes)
        return ok

    def write(self, keys: Sequence[BlockHash], blocks: torch.Tensor) -> int:
        return self.store.write(keys, blocks)

    def age(self, keys: Sequence[BlockHash], seconds: float) -> int:
        """The store's eviction hint (program-aware eviction): no bytes cross the link."""
        return self.store.age(keys, seconds)

    def stats(self) -> object:
        return self.store.stats()
