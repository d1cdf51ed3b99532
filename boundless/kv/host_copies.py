"""Copies from the device down to host memory queued in the device's stream order, landed later.

A window decided ahead (asynchronous scheduling) may take device blocks whose KV is kept in host memory first (a
demotion, ``KVCacheManager._demote_from_device``). Copied at once (``apply_transfers``), a device-to-host copy waits
for everything queued on the device before it: the window still running. :func:`queue_host_copies` queues instead,
for each batch, a gather of the blocks on the device and its copy into a pinned buffer, behind the running window and
ahead of the new window's passes (which may overwrite those blocks); :meth:`HostCopies.land` writes the buffers into
the host tier once the new window has been read back (its read-back waits for everything queued before it). Until
then the host blocks hold nothing: only an ordinary step, after the engine waited for every window, reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from boundless.attention.backend import to_host
from boundless.kv.tiers import KVTier
from boundless.kv.transfer import DEVICE, HOST, BlockTransfer, TierId, plan_transfers


class HostCopies:
    """Device-to-host block copies in flight: each batch's host tier, its blocks there, and the buffer (pinned on a
    GPU) their KV lands in first."""

    def __init__(self, batches: list[tuple[KVTier, tuple[int, ...], torch.Tensor]]) -> None:
        self.batches = batches

    def land(self) -> None:
        """Write the copied blocks into host memory (after the device has run the copies: the caller waited)."""
        for tier, dst_ids, buffer in self.batches:
            tier.write_blocks(dst_ids, buffer)


def queue_host_copies(
    transfers: Sequence[BlockTransfer], tiers: Mapping[TierId, KVTier]
) -> tuple[Sequence[BlockTransfer], HostCopies | None]:
    """Queue ``transfers`` when all of them copy device blocks to host memory (a window ahead's demotions): returns
    no transfers left to apply and the copies to land. Any other mix is returned as it is, to be applied at once."""
    if not transfers or any(t.src.tier != DEVICE or t.dst.tier != HOST for t in transfers):
        return transfers, None
    batches = []
    for batch in plan_transfers(transfers):
        buffer, _ = to_host(tiers[DEVICE].read_blocks(batch.src_ids))  # (a gather queued on the device, then its copy)
        batches.append((tiers[HOST], batch.dst_ids, buffer))
    return (), HostCopies(batches)
