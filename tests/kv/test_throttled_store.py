"""A store whose reads wait for an emulated storage link: the bytes read cross the link, probes and misses
cost nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from disk_store_worker import BIG, LAYOUT, block_of, blocks_of, key_of

from boundless.cluster.links import Link, ThrottledLink
from boundless.kv.disk_moves import DiskAge, DiskRead
from boundless.kv.disk_store import DiskKVStore
from boundless.kv.tensors import PagedKVCache
from boundless.kv.throttled_store import ThrottledStore
from boundless.kv.tier_io import TierIO
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import DEVICE, HOST

BLOCK_BYTES = LAYOUT.file_spec().payload_bytes


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_reads_wait_for_their_bytes_to_cross_the_link(dict_store: type) -> None:
    base = dict_store()
    block = torch.ones(2, 2, 1, 4, 8)  # one block: [layers, 2, kv_heads, block_size, head_dim], 512 bytes
    base.write([b"a", b"b"], torch.stack([block, block], dim=3))
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=1024.0), clock, clock.sleep)
    store = ThrottledStore(base, link.transfer)
    assert store.contains(b"a") and clock.now == 0.0  # a probe costs no bandwidth
    blocks = store.read([b"a", b"b", b"missing"])
    assert blocks[2] is None and torch.equal(blocks[0], block)
    assert clock.now == 1.0  # two blocks of 512 bytes at 1024 bytes/s
    assert link.stats().bytes_carried["kv"] == 1024
    store.read([b"missing"])
    assert clock.now == 1.0


def test_a_layerwise_load_is_carried_in_parts_queued_at_once_each_reported_as_it_crosses(dict_store: type) -> None:
    base = dict_store()
    base.write([b"a"], torch.ones(2, 2, 1, 1, 4, 8))
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=1024.0), clock, clock.sleep)
    store = ThrottledStore(base, link.transfer, link.transfer_parts)
    assert store.read_unpaced([b"a"])[0] is not None and clock.now == 0.0  # read now, carried after
    arrived: list[tuple[int, float, int]] = []

    def on_part(i: int) -> None:
        arrived.append((i, clock.now, link.stats().bytes_queued["kv"]))

    store.carry([256, 256], on_part)
    # Both parts queued at once (the link's queue, the scheduler's read queue, shows the whole load), each
    # reported when its bytes have crossed.
    assert arrived == [(0, 0.25, 256), (1, 0.5, 0)]


def test_without_a_parts_throttle_a_load_is_carried_part_after_part(dict_store: type) -> None:
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=1024.0), clock, clock.sleep)
    store = ThrottledStore(dict_store(), link.transfer)
    times: list[float] = []
    store.carry([512, 1024], lambda i: times.append(clock.now))
    assert times == [0.5, 1.5]


class SlowReads:
    """The real disk store, whose file reads take ``read_s`` on the virtual clock (the CPU a read costs)."""

    def __init__(self, store: DiskKVStore, clock: VirtualClock, read_s: float) -> None:
        self.store, self.clock, self.read_s = store, clock, read_s

    def contains(self, key: bytes) -> bool:
        return self.store.contains(key)

    def read_into(self, keys: Sequence[bytes], out: torch.Tensor) -> list[bool]:
        self.clock.now += self.read_s
        return self.store.read_into(keys, out)


def _flip_payload_bit(store: DiskKVStore, i: int) -> None:
    path = store._path(key_of(i))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("overlap", [True, False])
def test_a_read_into_overlaps_its_file_reads_with_the_link_and_still_checks_every_block(
    tmp_path: Path, overlap: bool
) -> None:
    disk = DiskKVStore(tmp_path, LAYOUT, BIG)
    disk.write([key_of(i) for i in range(3)], blocks_of([0, 1, 2]))
    _flip_payload_bit(disk, 1)
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=3 * BLOCK_BYTES), clock, clock.sleep)  # 3 blocks: 1 s
    store = ThrottledStore(SlowReads(disk, clock, read_s=0.5), link.transfer, None, link.begin if overlap else None)
    out = torch.zeros((3, *LAYOUT.block_shape))
    assert store.read_into([key_of(0), key_of(1), key_of(2)], out) == [True, False, True]
    assert torch.equal(out[0], block_of(0)) and torch.equal(out[2], block_of(2))
    assert disk.stats().checksum_failures == 1  # the flipped bit caught, as without the link
    if overlap:
        # Every asked block's bytes were queued before the files were read: the read takes the link's 1 s, its
        # 0.5 s of file reads under it, and the block that failed its check was carried for nothing.
        assert clock.now == 1.0 and link.stats().bytes_carried["kv"] == 3 * BLOCK_BYTES
    else:
        # Read, then carried: the two blocks that came back, after the 0.5 s of file reads.
        assert clock.now == pytest.approx(0.5 + 2 / 3) and link.stats().bytes_carried["kv"] == 2 * BLOCK_BYTES


def test_the_loader_reads_a_throttled_disk_store_into_host_blocks_through_its_buffer(tmp_path: Path) -> None:
    disk = DiskKVStore(tmp_path, LAYOUT, BIG)
    disk.write([key_of(i) for i in range(4)], blocks_of([0, 1, 2, 3]))
    _flip_payload_bit(disk, 2)
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=BLOCK_BYTES), clock, clock.sleep)
    store = ThrottledStore(disk, link.transfer, link.transfer_parts, link.begin)
    device = PagedKVCache(
        LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 4, LAYOUT.block_size, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip
    io = TierIO({DEVICE: device, HOST: HostKVTier(device, 4)}, store, background=False)
    io.apply([DiskRead(0, tuple(key_of(i) for i in range(4)), (3, 2, 1, 0))], [], [])
    assert [d.num_found for d in io.report().reads] == [2]  # the leading run before the damaged block
    host = io.tiers[HOST].read_blocks([3, 2])  # [layers, 2, kv_heads, n, block_size, head_dim]
    assert torch.equal(host[:, :, :, 0], block_of(0)) and torch.equal(host[:, :, :, 1], block_of(1))
    assert io._staging is not None  # through the loader's reused buffer, not a fresh tensor per block
    assert link.stats().bytes_carried["kv"] == 4 * BLOCK_BYTES and clock.now == 4.0


class HeldReads:
    """The real disk store, whose reads wait until ``release`` is set (a loader busy with a read)."""

    def __init__(self, store: DiskKVStore) -> None:
        self.store = store
        self.release = threading.Event()

    def contains(self, key: bytes) -> bool:
        return self.store.contains(key)

    def read_into(self, keys: Sequence[bytes], out: torch.Tensor) -> list[bool]:
        self.release.wait(timeout=30)
        return self.store.read_into(keys, out)

    def stats(self) -> object:
        return self.store.stats()


def test_the_node_read_queue_counts_the_loads_waiting_for_the_loader_not_only_the_one_on_the_link(
    tmp_path: Path,
) -> None:
    disk = DiskKVStore(tmp_path, LAYOUT, BIG)
    disk.write([key_of(i) for i in range(5)], blocks_of(list(range(5))))
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=BLOCK_BYTES), clock, clock.sleep)
    held = HeldReads(disk)
    store = ThrottledStore(held, link.transfer, link.transfer_parts, link.begin, link.announce)
    device = PagedKVCache(
        LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 4, LAYOUT.block_size, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip
    io = TierIO({DEVICE: device, HOST: HostKVTier(device, 5)}, store)
    try:
        io.apply([DiskRead(0, (key_of(0),), (0,))], [], [])  # the loader starts it and waits on the store
        io.apply([DiskRead(1, (key_of(1), key_of(2)), (1, 2)), DiskRead(2, (key_of(3), key_of(4)), (3, 4))], [], [])
        deadline = time.monotonic() + 10
        while link.stats().bytes_queued.get("kv", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the first read is on the link
        queued = link.stats().bytes_queued
        assert queued["kv"] == BLOCK_BYTES and queued["waiting"] == 4 * BLOCK_BYTES  # five blocks in the read queue
        held.release.set()
        io.flush()
        assert [r.num_found for r in io.report().reads] == [1, 2, 2]
        assert link.stats().queued_bytes == 0 and link.stats().bytes_carried["kv"] == 5 * BLOCK_BYTES
    finally:
        held.release.set()
        io.close()


def test_the_stores_eviction_hints_and_listing_pass_through_the_link(tmp_path: Path) -> None:
    # An engine with a disk store and a read link (prefill and decode engines with --storage-gbps): program-aware
    # eviction's hints had failed in the writer (no ``age`` here), and a restarted engine probed for every stored block.
    disk = DiskKVStore(tmp_path, LAYOUT, BIG)
    disk.write([key_of(i) for i in range(3)], blocks_of([0, 1, 2]))
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=BLOCK_BYTES), clock, clock.sleep)
    store = ThrottledStore(DiskKVStore(tmp_path, LAYOUT, BIG), link.transfer)
    device = PagedKVCache(
        LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 4, LAYOUT.block_size, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip
    io = TierIO({DEVICE: device, HOST: HostKVTier(device, 4)}, store, background=False)
    io.apply([], [], [], [DiskAge((key_of(2),), 3600.0)])
    report = io.report()
    assert report.io is not None and report.io.blocks_aged == 1
    assert set(report.held_at_open) == {key_of(i) for i in range(3)}
    assert DiskKVStore(tmp_path, LAYOUT, BIG).held_keys()[0] == key_of(2)  # first to go now
    assert clock.now == 0.0  # neither crossed the link


def test_the_store_behind_the_link_describes_itself(tmp_path: Path) -> None:
    # The engine's start-up line for its store: behind a read link (prefill and decode engines with --storage-gbps) it
    # was the raw ``StoreStats(hits=0, ...)`` where a store without one says what it holds and for which model.
    disk = DiskKVStore(tmp_path, LAYOUT, BIG)
    disk.write([key_of(0)], blocks_of([0]))
    clock = VirtualClock()
    link = ThrottledLink(Link("storage", bytes_per_s=BLOCK_BYTES), clock, clock.sleep)
    store = ThrottledStore(DiskKVStore(tmp_path, LAYOUT, BIG), link.transfer)
    assert store.describe() == f"{DiskKVStore(tmp_path, LAYOUT, BIG).describe()}; read over an emulated storage link"
