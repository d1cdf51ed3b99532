"""KV moves between tiers: where a block is, a move from one place to another, and the order moves run in.

A KV block lives in a tier (device memory, host memory; next a disk store, or another instance) and is found
there by its tier and a block id (:class:`BlockRef`). The scheduler emits a step's moves as
:class:`BlockTransfer` s, in the order it decided them; the executor applies them before the forward pass.

Moves run batched, one batch per pair of tiers: first the transfers out of the device, then those between
other tiers, then those into the device (:func:`plan_transfers`). The batches give what the decided order
gives only while the scheduler keeps three rules:

- a device block a transfer out frees may be the destination of a transfer in (out runs first);
- a block below the device that a transfer reads stays taken until the next step, so no transfer of the
  same step writes it (``KVCacheManager.begin_step`` frees it);
- a request moves back to the device only with room for its blocks and its chunk's growth, so it is not
  moved out again, from blocks its own transfer in has not filled, in the same step.

:func:`plan_transfers` checks the result against the decided order and raises
:class:`TransferOrderError` rather than copy stale KV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from boundless.kv.tiers import KVTier

TierId = str  # "device", "host", "disk", "peer"; a tier added later names itself
DEVICE: TierId = "device"
HOST: TierId = "host"
DISK: TierId = "disk"  # addressed by block name, not by id: its moves are kv/disk_moves.py's
PEER: TierId = "peer"  # other instances, reached by block streams (kv/remote_moves.py): an origin, not a pool


# Named tuples (immutable, hashable, and made in half a frozen dataclass's time): a busy engine makes three for every
# block it moves between tiers.
class BlockRef(NamedTuple):
    """A KV block in a tier: the tier and the block's id in that tier's pool."""

    tier: TierId
    block_id: int


class BlockTransfer(NamedTuple):
    """Copy one block's KV (all layers) from ``src`` to ``dst``."""

    src: BlockRef
    dst: BlockRef


@dataclass(frozen=True)
class TransferBatch:
    """The step's transfers from one tier to another, applied as one read and one write."""

    src_tier: TierId
    dst_tier: TierId
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]


class TransferOrderError(RuntimeError):
    """A step's transfers cannot run batched without reading or writing a block out of turn."""


def _rank(src: TierId, dst: TierId) -> tuple[int, TierId, TierId]:
    """Batches out of the device first, into the device last."""
    stage = 0 if src == DEVICE and dst != DEVICE else 2 if dst == DEVICE else 1
    return stage, src, dst


def plan_transfers(transfers: Sequence[BlockTransfer]) -> list[TransferBatch]:
    """The batches that apply ``transfers``, in the order they run.

    Each batch reads all its sources before it writes; checked against the decided order, a transfer that
    reads a block must run after every earlier transfer that writes it, one that writes a block no earlier
    than every earlier transfer that reads it, and after every earlier one that writes it.
    """
    pairs = sorted({(t.src.tier, t.dst.tier) for t in transfers}, key=lambda p: _rank(*p))
    batch_of = {pair: i for i, pair in enumerate(pairs)}
    last_write: dict[BlockRef, int] = {}
    last_read: dict[BlockRef, int] = {}
    for t in transfers:
        b = batch_of[(t.src.tier, t.dst.tier)]
        if last_write.get(t.src, -1) >= b:
            raise TransferOrderError(f"{t.src} is read before an earlier transfer writes it")
        if last_write.get(t.dst, -1) >= b or last_read.get(t.dst, -1) > b:
            raise TransferOrderError(f"{t.dst} is written out of turn with an earlier transfer")
        last_read[t.src] = max(last_read.get(t.src, -1), b)
        last_write[t.dst] = b
    batches = []
    for src, dst in pairs:
        mine = [t for t in transfers if t.src.tier == src and t.dst.tier == dst]
        batches.append(
            TransferBatch(src, dst, tuple(t.src.block_id for t in mine), tuple(t.dst.block_id for t in mine))
        )
    return batches


def apply_transfers(transfers: Sequence[BlockTransfer], tiers: Mapping[TierId, KVTier]) -> None:
    """Copy every transfer's block, batch by batch (see :func:`plan_transfers`)."""
    for batch in plan_transfers(transfers):
        missing = {batch.src_tier, batch.dst_tier} - tiers.keys()
        if missing:
            raise KeyError(f"a transfer names a tier this executor lacks: {sorted(missing)}")
        tiers[batch.dst_tier].write_blocks(batch.dst_ids, tiers[batch.src_tier].read_blocks(batch.src_ids))
