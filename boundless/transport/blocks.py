"""KV blocks of a tier over a transport: the remote half of the tier seam (``kv/tiers.py``).

A sender gathers the blocks (``KVTier.read_blocks``: one contiguous tensor, [layers, 2, kv_heads, n,
block_size, head_dim], since a tier keeps a block's bytes apart per layer and head) and sends it as one
message; the receiver takes it into a tensor of the same shape and writes it into its own tier at the
block ids it reserved (``write_blocks``). Block ids are each side's own: the control plane tells the
receiver how many blocks come with which tag, and the receiver chooses where they go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from boundless.kv.tiers import KVTier
from boundless.transport.base import KVTransport, TransferHandle, TransportError


def send_blocks(transport: KVTransport, peer: str, tag: int, tier: KVTier, block_ids: Sequence[int]) -> TransferHandle:
    """Send these blocks' KV (all layers) as one message."""
    return transport.send(peer, tag, tier.read_blocks(block_ids).contiguous())


class BlocksReceive:
    """A receive of ``len(block_ids)`` blocks into ``tier`` at ``block_ids``; the blocks are written into
    the tier when the receive is seen complete (by ``done`` or ``wait``), and never after a timeout."""

    def __init__(self, transport: KVTransport, peer: str, tag: int, tier: KVTier, block_ids: Sequence[int]) -> None:
        self.block_ids = list(block_ids)
        self._tier = tier
        shape = list(tier.read_blocks([]).shape)  # the tier's block layout, with no blocks
        shape[3] = len(self.block_ids)
        self._stage = torch.empty(shape, dtype=tier.read_blocks([]).dtype)
        self._handle = transport.recv(peer, tag, self._stage)
        self._written = False

    def _write(self) -> None:
        if not self._written:
            self._tier.write_blocks(self.block_ids, self._stage)
            self._written = True

    def done(self) -> bool:
        if self._handle.done():
            self._write()
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> None:
        self._handle.wait(timeout_s)
        self._write()

    def cancel(self) -> None:
        """Give the receive up: one still pending is cancelled, and nothing is written into the tier after."""
        self._written = True
        if not self._handle.done():
            with contextlib.suppress(TransportError):
                self._handle.wait(0)
