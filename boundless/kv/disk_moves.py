"""Moves to and from the disk store: plain data between the KV manager and the executor.

The disk tier differs from the memory tiers in two ways. It is addressed by block name (the chained
hash), not by a block id in a pool of ours: the store is shared with other processes and outlives this
one. And its moves are asynchronous: a step does not wait for the disk. So they travel apart from the
step's :class:`~boundless.kv.transfer.BlockTransfer` s:

- a :class:`DiskRead` loads the leading run of a request's next blocks that the store has into host
  blocks reserved for it (or, as a probe, only counts that run); a background loader runs it, and the
  executor reports a :class:`DiskReadDone` in a later step's result;
- a :class:`DiskAge` asks the store to put blocks no live program uses first in its eviction order;
- a :class:`DiskWrite` copies device or host blocks to the store. The executor snapshots their KV before
  the step's transfers and forward pass (so nothing of the step can overwrite them first) and hands the
  snapshot to a background writer whose queue is bounded: a write that does not fit is dropped, never
  waited for. Each write is reported back as a :class:`DiskWriteDone`.

Loads land in host memory, never straight on the device: a request whose blocks were loaded is then
admitted like one whose prefix sits in host memory, with host-to-device transfers in its step.
"""

from __future__ import annotations

from dataclasses import dataclass

from boundless.kv.block_hash import BlockHash
from boundless.kv.transfer import TierId


@dataclass(frozen=True)
class DiskRead:
    """Read the leading run of ``keys`` that the store has: into host blocks ``dst_ids`` (one per key),
    or, with no ``dst_ids``, only count it (a probe)."""

    read_id: int
    keys: tuple[BlockHash, ...]
    dst_ids: tuple[int, ...] = ()
    # A read ahead for a call not yet here (``KVCacheManager.plan_prefetch_reads``): the loader runs it only when no
    # read of a request already here is waiting, so a placed call's read waits behind at most the one in progress.
    ahead: bool = False

    @property
    def is_probe(self) -> bool:
        return not self.dst_ids


@dataclass(frozen=True)
class DiskWrite:
    """Write the KV of blocks ``src_ids`` of tier ``src_tier`` to the store under ``keys``."""

    src_tier: TierId
    src_ids: tuple[int, ...]
    keys: tuple[BlockHash, ...]


@dataclass(frozen=True)
class DiskAge:
    """A hint to the store: set the LRU stamps of ``keys`` back by ``seconds``, so that they are evicted before
    blocks used since (program-aware eviction: no program still alive uses them). Dropped if it cannot run."""

    keys: tuple[BlockHash, ...]
    seconds: float


@dataclass(frozen=True)
class DiskReadDone:
    """A finished read: the store had the first ``num_found`` keys (a load put them in its host blocks)."""

    read_id: int
    num_found: int
    seconds: float


@dataclass(frozen=True)
class DiskWriteDone:
    """A finished write: ``written`` keys are now in the store; ``dropped`` never went (the queue was full),
    ``failed`` went and did not land (the store's I/O failed)."""

    written: tuple[BlockHash, ...] = ()
    dropped: tuple[BlockHash, ...] = ()
    failed: tuple[BlockHash, ...] = ()


@dataclass
class DiskIOStats:
    """The executor's disk I/O so far (cumulative)."""

    probes: int = 0
    loads: int = 0
    # summed over loads, from the loader taking one up to its blocks in host memory (a layerwise load: read and
    # checked, before its link has carried it)
    load_seconds: float = 0.0
    blocks_loaded: int = 0
    blocks_missing: int = 0  # asked for by a load but missing or unreadable (recomputed instead)
    blocks_written: int = 0
    blocks_dropped: int = 0  # write-through or write-back blocks dropped because the writer's queue was full
    blocks_failed: int = 0  # writes the store could not complete
    blocks_aged: int = 0  # blocks the store put first in its eviction order (no live program uses them)
    # Layerwise loads (kv/layer_gate.py): loads reported before their link had carried them, the seconds forward
    # passes waited at a layer for one to arrive, and the gates waited past (their link stuck past the timeout).
    layerwise_loads: int = 0
    layer_wait_s: float = 0.0
    layer_wait_timeouts: int = 0
    store: object | None = None  # the store's own stats (DiskKVStore.stats()), as it last reported them


@dataclass(frozen=True)
class TierReport:
    """What the executor's background I/O finished since its last report, with its running totals."""

    reads: tuple[DiskReadDone, ...] = ()
    writes: tuple[DiskWriteDone, ...] = ()
    io: DiskIOStats | None = None
    # What the store held when it was opened, least recently used first (in the first report only): the names
    # earlier processes wrote, so that a restarted engine loads them without probing first.
    held_at_open: tuple[BlockHash, ...] = ()
