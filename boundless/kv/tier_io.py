"""The executor's side of KV moves: copies between memory tiers, and the disk store's reads and writes.

Each step, :meth:`TierIO.apply` takes the step's moves as the KV manager decided them, in three stages:

1. snapshot the blocks the step writes to the store (device or host blocks, copied out before anything of
   the step can overwrite them; the executor takes them before it posts the step's receives from peers,
   ``snapshot_writes``) and hand them to the background writer; a write that does not fit the
   writer's bounded queue is dropped and counted instead, never waited for, so a slow disk never slows a
   step;
2. hand the step's reads to the background loader, whatever else happens (a request waits for each), and its
   eviction hints (``DiskAge``) to the writer, after its writes;
3. copy the step's transfers between memory tiers (``kv/transfer.py``: out of the device first).

The loader reads blocks into host blocks the manager reserved for them;
nothing else touches those until the read is reported, so it may write them while a step runs. Finished
reads and writes are collected by :meth:`TierIO.report` for the step's result.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, MutableMapping, Sequence

import torch

from boundless.attention.backend import to_host
from boundless.kv.disk_moves import (
    DiskAge,
    DiskIOStats,
    DiskRead,
    DiskReadDone,
    DiskWrite,
    DiskWriteDone,
    TierReport,
)
from boundless.kv.layer_gate import LayerGate
from boundless.kv.tiers import BlockStore, KVTier
from boundless.kv.transfer import HOST, BlockTransfer, TierId, apply_transfers

log = logging.getLogger(__name__)

# A write's blocks in host memory, and (from a GPU) the event that marks the end of their copy there.
_Snapshot = tuple[torch.Tensor, "torch.cuda.Event | None"]

# Blocks the writer may hold queued before it drops writes (at 720 KiB a block, SmolLM2-135M fp32: ~180 MiB).
DEFAULT_WRITE_QUEUE_BLOCKS = 256
# Blocks a load reads into its reused staging buffer at a time (at 720 KiB a block: 45 MiB, kept by the loader).
LOAD_CHUNK_BLOCKS = 64
STORE_STATS_EVERY_S = 1.0  # the store's own stats may cost I/O: asked at most this often


class _ReadQueue:
    """The loader's queue of reads: :meth:`get` gives the oldest read of a request already here, else the oldest
    read ahead (a placed call's read used to wait behind every chunk read ahead before it), else waits."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._now: deque[DiskRead] = deque()
        self._ahead: deque[DiskRead] = deque()
        self._closed = False

    def put(self, read: DiskRead | None) -> None:
        with self._ready:
            if read is None:
                self._closed = True
            else:
                (self._ahead if read.ahead else self._now).append(read)
            self._ready.notify()

    def get(self) -> DiskRead | None:
        with self._ready:
            while not (self._closed or self._now or self._ahead):
                self._ready.wait()
            if self._closed:
                return None
            return (self._now or self._ahead).popleft()


class TierIO:
    """Moves KV between ``tiers`` (memory, by block id) and ``store`` (disk, by name; optional).

    ``background=False`` runs reads and writes in the caller's thread as they are handed over (their results
    still come with the next :meth:`report`): deterministic, for tests. ``clock`` times the loads.

    ``layerwise`` (with a store behind an emulated link, ``kv/throttled_store.py``): a load is reported done as
    soon as its blocks are read and checked, and its link then carries it layer by layer while a
    :class:`~boundless.kv.layer_gate.LayerGate` per load tells which layers have arrived (:meth:`gates_for`): the
    request is admitted meanwhile and its forward pass waits at each layer for that layer only. Without it a
    load is reported once the link has carried all of it.

    ``on_read_done`` is called with each finished read as it is kept for the next report (in the loader's thread): a
    rank of a split model tells rank 0 at once (``engine/rank_process.py``).
    """

    def __init__(
        self,
        tiers: MutableMapping[TierId, KVTier],
        store: BlockStore | None = None,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
        background: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        layerwise: bool = False,
        on_read_done: Callable[[DiskReadDone], None] | None = None,
    ) -> None:
        self.tiers = tiers
        self.on_read_done = on_read_done
        self.store = store
        self.layerwise = layerwise
        # Host blocks whose load is still crossing its link, layer by layer: the gate of each (kv/layer_gate.py).
        self._gates: dict[int, LayerGate] = {}
        self.write_queue_blocks = write_queue_blocks
        self.background = background
        self.clock = clock
        self.stats = DiskIOStats()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._reads_done: list[DiskReadDone] = []
        self._writes_done: list[DiskWriteDone] = []
        self._queued_blocks = 0  # blocks waiting in the writer's queue
        self._reads_pending = 0
        # The loader's queue: reads of requests here first, then reads ahead (``DiskRead.ahead``), each in order;
        # None (closing) goes first of all.
        self._read_queue = _ReadQueue()
        self._write_queue: queue.Queue[tuple[DiskWrite, _Snapshot] | DiskAge | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._staging: torch.Tensor | None = None  # the loader's, for stores that read into a given buffer
        self._store_stats_at = -STORE_STATS_EVERY_S
        # Held from asking the store for its stats until they are kept, so that they are kept in the order they were
        # taken: a snapshot taken before a read's checksum failure must not overwrite the read's own, taken after.
        self._store_stats_lock = threading.Lock()
        held_keys = getattr(store, "held_keys", None)
        self._held_at_open: tuple[bytes, ...] = tuple(held_keys()) if held_keys is not None else ()
        if store is not None and background:
            for name, target in (("loader", self._load_loop), ("writer", self._write_loop)):
                thread = threading.Thread(target=target, name=f"boundless-kv-{name}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def snapshot_writes(self, writes: Sequence[DiskWrite]) -> list[tuple[DiskWrite, _Snapshot]]:
        """Stage 1 alone: the blocks of the step's writes as they are now (for :meth:`apply`'s ``snapshots``), taken
        before anything may write into them (the executor's receives from a peer: a receive's host blocks may be
        ones evicted for it, whose old KV a write-back is taking to the store)."""
        snapshots = []
        for write in writes:
            if self._make_room_for(write):
                try:
                    snapshots.append((write, self._snapshot(write)))
                except BaseException:
                    self._finish_write(write, written=False)
                    raise
        return snapshots

    def apply(
        self,
        reads: Sequence[DiskRead],
        writes: Sequence[DiskWrite],
        transfers: Sequence[BlockTransfer],
        ages: Sequence[DiskAge] = (),
        snapshots: list[tuple[DiskWrite, _Snapshot]] | None = None,
    ) -> None:
        """Start the step's disk writes, reads and eviction hints, then copy its transfers (see the module's
        stages); ``snapshots``: the writes' blocks taken already (``snapshot_writes``)."""
        try:
            if snapshots is None:
                snapshots = self.snapshot_writes(writes)
        finally:
            for read in reads:  # a request waits for each read: it starts even if the step fails
                self._submit_read(read)
        for write, snapshot in snapshots:
            if self.background:
                self._write_queue.put((write, snapshot))
            else:
                self._run_write(write, snapshot)
        for age in ages if self.store is not None else ():
            if self.background:
                self._write_queue.put(age)
            else:
                self._run_age(age)
        apply_transfers(transfers, self.tiers)

    def report(self, wait_s: float = 0.0) -> TierReport:
        """What finished since the last report; with ``wait_s``, wait that long at most for a read to finish
        when none has (a step with nothing else to do)."""
        now = time.monotonic()
        if self.store is not None and now - self._store_stats_at >= STORE_STATS_EVERY_S:
            self._store_stats_at = now
            self._keep_store_stats()
        with self._done:
            if wait_s > 0 and not self._reads_done and self._reads_pending:
                self._done.wait(timeout=wait_s)
            reads, self._reads_done = self._reads_done, []
            writes, self._writes_done = self._writes_done, []
            stats = DiskIOStats(**vars(self.stats))
            held, self._held_at_open = self._held_at_open, ()
        return TierReport(tuple(reads), tuple(writes), stats, held)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every read and write handed over so far has finished."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            while self._reads_pending or self._queued_blocks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the KV store's reads and writes did not finish")
                self._done.wait(timeout=left)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the background threads: the writer once the writes handed over so far are in the store (for at
        most ``timeout_s``: storage may be stuck); the loader without waiting (a load now has nobody to serve)."""
        self._read_queue.put(None)
        self._write_queue.put(None)
        for thread in self._threads:
            if thread.name.endswith("writer"):
                thread.join(timeout=timeout_s)

    # -- reads ---------------------------------------------------------------------------------

    def _submit_read(self, read: DiskRead) -> None:
        with self._lock:
            self._reads_pending += 1
        if self.background and self.store is not None:
            self._announce(read, 1)
            self._read_queue.put(read)
        else:
            self._run_read(read)

    def _load_loop(self) -> None:
        while (read := self._read_queue.get()) is not None:
            self._announce(read, -1)
            self._run_read(read)

    def _announce(self, read: DiskRead, sign: int) -> None:
        """Tell a store behind an emulated link (``ThrottledStore.announce``) of a load waiting for the loader (1)
        or started (-1): its bytes count in the node's read queue while they wait."""
        announce = getattr(self.store, "announce", None)
        if announce is not None and not read.is_probe and HOST in self.tiers:
            announce(sign * len(read.keys) * self._layer_block_bytes() * self._num_layers())

    @property
    def reads_pending(self) -> int:
        """Reads handed over and not yet reported done (queued, or in progress: files or link)."""
        return self._reads_pending

    def gates_for(self, host_block_ids: Sequence[int]) -> list[LayerGate]:
        """The gates of the loads still carrying any of these host blocks (each once)."""
        with self._lock:
            if not self._gates:
                return []
            gates = {id(g): g for b in host_block_ids if (g := self._gates.get(b)) is not None and not g.is_open}
        return list(gates.values())

    def count_layer_waits(self, seconds: float, timeouts: int) -> None:
        """What a step's forward pass spent waiting for layerwise loads (for the stats)."""
        with self._lock:
            self.stats.layer_wait_s += seconds
            self.stats.layer_wait_timeouts += timeouts

    def _run_read(self, read: DiskRead) -> None:
        start = self.clock()
        found = 0
        carry = getattr(self.store, "carry", None) if self.layerwise and not read.is_probe else None
        try:
            found = self._probe(read.keys) if read.is_probe else self._load(read, paced=carry is None)
        except Exception:  # the store does not raise for I/O trouble; anything else must not kill the loader
            log.exception("reading KV blocks from the store failed")
        seconds = self.clock() - start
        self._keep_store_stats()  # before the read is reported: its checksum failures come with it
        gate = LayerGate(self._num_layers()) if carry is not None and found else None
        with self._done:
            if gate is not None:  # before the read is reported: no step may use its blocks unguarded
                for block_id in read.dst_ids[:found]:
                    self._gates[block_id] = gate
            if gate is not None:
                self.stats.layerwise_loads += 1
            if read.is_probe:
                self.stats.probes += 1
            else:
                self.stats.loads += 1
                self.stats.load_seconds += seconds
                self.stats.blocks_loaded += found
                self.stats.blocks_missing += len(read.keys) - found
            done = DiskReadDone(read.read_id, found, seconds)
            self._reads_done.append(done)
            self._reads_pending -= 1
            self._done.notify_all()
        if self.on_read_done is not None:
            self.on_read_done(done)
        if gate is not None:
            assert carry is not None
            try:
                carry([found * self._layer_block_bytes()] * gate.num_layers, gate.open_through)
            except Exception:  # the bytes are in host memory: a failed link only stops pacing them
                log.exception("carrying a layerwise load over its link failed")
            finally:
                gate.open_all()
                with self._lock:
                    for block_id in read.dst_ids[:found]:
                        if self._gates.get(block_id) is gate:
                            del self._gates[block_id]

    def _num_layers(self) -> int:
        return int(self.tiers[HOST].data.shape[0])  # type: ignore[attr-defined]

    def _layer_block_bytes(self) -> int:
        """Bytes of one layer of one block: [2, kv_heads, block_size, head_dim]."""
        data = self.tiers[HOST].data  # type: ignore[attr-defined]
        return int(data[0, :, :, 0].numel() * data.element_size())

    def count_stored(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds, in the caller's thread (a probe: one stat each)."""
        return self._probe(keys)

    def _probe(self, keys: Sequence[bytes]) -> int:
        if self.store is None:
            return 0
        found = 0
        while found < len(keys) and self.store.contains(keys[found]):
            found += 1
        return found

    def _load(self, read: DiskRead, paced: bool = True) -> int:
        """Read ``read.keys`` and put the leading run that came back whole into its host blocks; not ``paced``:
        without waiting for the store's link (a layerwise load is carried over it afterwards)."""
        if self.store is None:
            return 0
        host = self.tiers[HOST]
        data = getattr(host, "data", None)  # the host tier's memory, for the shape of one block
        if data is not None and paced and hasattr(self.store, "read_into"):
            return self._load_staged(read, data)
        blocks = self.store.read(read.keys) if paced else self.store.read_unpaced(read.keys)  # type: ignore[attr-defined]
        shape = None if data is None else tuple(data.shape[:3]) + tuple(data.shape[4:])
        good = []
        for block in blocks:
            if block is None or (shape is not None and tuple(block.shape) != shape):
                break  # missing, unreadable, or of another layout: recomputed, never served
            good.append(block)
        if good:
            host.write_blocks(read.dst_ids[: len(good)], torch.stack(good, dim=3))
        return len(good)

    def _load_staged(self, read: DiskRead, data: torch.Tensor) -> int:
        """:meth:`_load` for a store that reads into a given buffer: the files' payloads land in the loader's
        reused staging buffer and are copied once into their host blocks (no fresh memory per block, no stack)."""
        host, store = self.tiers[HOST], self.store
        shape = (LOAD_CHUNK_BLOCKS, *data.shape[:3], *data.shape[4:])
        if self._staging is None or tuple(self._staging.shape) != shape or self._staging.dtype != data.dtype:
            self._staging = torch.empty(shape, dtype=data.dtype)
        staging, found = self._staging, 0
        for start in range(0, len(read.keys), LOAD_CHUNK_BLOCKS):
            keys = read.keys[start : start + LOAD_CHUNK_BLOCKS]
            ok = store.read_into(keys, staging)  # type: ignore[union-attr]
            whole = next((i for i, good in enumerate(ok) if not good), len(ok))  # missing or bad: recomputed
            if whole:
                # [n, layers, 2, heads, bs, dim] -> the tiers' [layers, 2, heads, n, bs, dim], copied into place.
                host.write_blocks(read.dst_ids[start : start + whole], staging[:whole].permute(1, 2, 3, 0, 4, 5))
            found += whole
            if whole < len(keys):
                break
        return found

    # -- writes --------------------------------------------------------------------------------

    def _make_room_for(self, write: DiskWrite) -> bool:
        """Take room in the writer's queue for ``write``, or drop it (counted) when there is none."""
        n = len(write.keys)
        with self._done:
            if self.store is None or self._queued_blocks + n > self.write_queue_blocks:
                self.stats.blocks_dropped += n
                self._writes_done.append(DiskWriteDone(dropped=write.keys))
                return False
            self._queued_blocks += n
            return True

    def _snapshot(self, write: DiskWrite) -> _Snapshot:
        """The blocks' KV as it is now, in host memory; from a GPU the copy runs on, and an event marks its end."""
        return to_host(self.tiers[write.src_tier].read_blocks(write.src_ids))

    def _write_loop(self) -> None:
        while (item := self._write_queue.get()) is not None:
            if isinstance(item, DiskAge):
                self._run_age(item)
            else:
                self._run_write(*item)

    def _run_age(self, age: DiskAge) -> None:
        """Pass an eviction hint on to the store; a hint that fails is only lost."""
        assert self.store is not None
        try:
            aged = self.store.age(age.keys, age.seconds)
        except Exception:  # the store does not raise for I/O trouble; anything else must not kill the writer
            log.exception("ageing KV blocks in the store failed")
            return
        with self._lock:
            self.stats.blocks_aged += aged

    def _run_write(self, write: DiskWrite, snapshot: _Snapshot) -> None:
        blocks, copied = snapshot
        written = 0
        try:
            assert self.store is not None
            if copied is not None:
                copied.synchronize()
            written = self.store.write(write.keys, blocks)
        except Exception:  # the store does not raise for I/O trouble; anything else must not kill the writer
            log.exception("writing KV blocks to the store failed")
        self._keep_store_stats()
        self._finish_write(write, written == len(write.keys))

    def _keep_store_stats(self) -> None:
        """Ask the store for its stats and keep them for the next report. After one of its reads or writes, before
        the result is reported: its checksum failures and write errors then come in the report that brings it."""
        if self.store is None:
            return
        with self._store_stats_lock:
            try:
                stats = self.store.stats()
            except Exception:
                log.exception("the KV store's stats failed")
                return
            with self._lock:
                self.stats.store = stats

    def _finish_write(self, write: DiskWrite, written: bool) -> None:
        # The store says how many landed, not which: all of them, or none that we count on.
        n = len(write.keys)
        with self._done:
            if written:
                self.stats.blocks_written += n
                self._writes_done.append(DiskWriteDone(written=write.keys))
            else:
                self.stats.blocks_failed += n
                self._writes_done.append(DiskWriteDone(failed=write.keys))
            self._queued_blocks -= n
            self._done.notify_all()
