"""Lower tiers as caches of named blocks: evictions move down, lookups find prefixes in every tier, the store's
reads and writes run in the background and never hold a step up.

The disk store here is conftest's ``DictStore`` (the ``BlockStore`` interface in a dict) or a subclass that
blocks or fails on purpose; the persistent store (``kv/disk_store.py``) plugs in behind the same interface.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from boundless.config import CacheConfig, ConfigError
from boundless.kv.disk_moves import DiskRead, DiskReadDone, DiskWrite, DiskWriteDone
from boundless.kv.manager import KVCacheManager
from boundless.kv.tensors import PagedKVCache
from boundless.kv.tier_io import TierIO
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import DEVICE, DISK, HOST, BlockRef, BlockTransfer, plan_transfers

BLOCK = 4


def _tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def _memory(num_blocks: int, host_blocks: int) -> tuple[PagedKVCache, dict]:
    device = PagedKVCache(1, 1, 1, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    return device, {DEVICE: device, HOST: HostKVTier(device, host_blocks)}


def _write_tokens(device: PagedKVCache, block_ids: list[int], tokens: list[int]) -> None:
    """The stand-in for a forward pass: each slot holds its token id + 1."""
    keys, _ = device.layer(0)
    for pos, token in enumerate(tokens):
        keys[0, block_ids[pos // BLOCK], pos % BLOCK, 0] = float(token + 1)


def _held(tier, block_id: int) -> list[int]:
    return [int(v) - 1 for v in tier.read_blocks([block_id])[0, 0, 0, 0, :, 0].tolist()]


def test_a_block_evicted_from_the_device_is_copied_to_host_before_it_is_overwritten() -> None:
    device, tiers = _memory(num_blocks=3, host_blocks=4)
    kv = KVCacheManager(3, BLOCK, True, "fp", num_host_blocks=4)
    a = _tokens(0, 9)  # two full blocks and one token
    assert kv.allocate("a", a, 8)
    _write_tokens(device, kv.block_ids("a"), a[:8])
    kv.free("a")
    kv.begin_step()
    b = _tokens(100, 12)
    assert kv.allocate("b", b, 12)  # takes the free block and both of a's cached ones
    moves = kv.take_transfers()
    assert [(t.src.tier, t.dst.tier) for t in moves] == [(DEVICE, HOST)] * 2
    TierIO(tiers).apply([], [], moves)
    _write_tokens(device, kv.block_ids("b"), b)  # the forward pass overwrites the device blocks
    assert sorted(_held(tiers[HOST], t.dst.block_id) for t in moves) == [a[:4], a[4:8]]
    # a's prefix is found in host memory, and copied back into device blocks at its admission.
    kv.free("b")
    kv.begin_step()
    prefix = kv.find_cached_prefix("a2", a)
    assert prefix.num_tokens == 8 and prefix.tiers == [HOST, HOST]
    assert kv.allocate("a2", a, 9, prefix)
    moves = kv.take_transfers()
    assert [(t.src.tier, t.dst.tier) for t in moves].count((HOST, DEVICE)) == 2
    plan_transfers(moves)  # b's blocks go down to host first, then a's come back into them
    TierIO(tiers).apply([], [], moves)
    assert [_held(device, i) for i in kv.block_ids("a2")[:2]] == [a[:4], a[4:8]]


def test_the_prefix_lookup_takes_each_block_from_the_device_else_from_host_memory() -> None:
    kv = KVCacheManager(3, BLOCK, True, "fp", num_host_blocks=4)
    a = _tokens(0, 13)
    assert kv.allocate("a", a, 12)
    kv.free("a")  # tail first: a's last block is the first to go
    kv.begin_step()
    assert kv.allocate("x", _tokens(500, 4), 4)
    assert len(kv.take_transfers()) == 1
    prefix = kv.find_cached_prefix("a2", a)
    assert prefix.num_tokens == 12 and prefix.tiers == [DEVICE, DEVICE, HOST]


def test_a_host_block_a_step_writes_is_not_taken_again_in_that_step() -> None:
    kv = KVCacheManager(2, BLOCK, True, "fp", num_host_blocks=1)
    assert kv.allocate("a", _tokens(0, 8), 8)
    kv.free("a")
    kv.begin_step()
    assert kv.allocate("b", _tokens(100, 8), 8)  # two evictions, room in host memory for one
    moves = kv.take_transfers()
    assert len(moves) == 1  # the second is dropped rather than overwrite the first's copy in the same step
    plan_transfers(moves)


def test_write_back_sends_a_block_to_the_store_when_it_leaves_host_memory() -> None:
    kv = KVCacheManager(1, BLOCK, True, "fp", num_host_blocks=1, disk=True, write_policy="back")
    for i, first in enumerate((0, 100, 200)):
        kv.begin_step()
        assert kv.allocate(f"r{i}", _tokens(first, 4), 4)
        kv.free(f"r{i}")
        kv.take_transfers()
        writes = kv.take_disk_writes()
        if i < 2:
            assert writes == []  # the device keeps r0; then host memory keeps it
        else:
            (write,) = writes  # r0 leaves host memory for r1's block: to the store
            assert write.src_tier == HOST and len(write.keys) == 1


def test_write_through_sends_a_block_to_the_store_the_step_after_it_is_computed() -> None:
    kv = KVCacheManager(8, BLOCK, True, "fp", num_host_blocks=4, disk=True, write_policy="through")
    kv.begin_step()
    assert kv.allocate("a", _tokens(0, 9), 9)
    assert kv.take_disk_writes() == []  # named now, computed by this step's forward pass
    kv.begin_step()
    (write,) = kv.take_disk_writes()
    assert write.src_tier == DEVICE and write.src_ids == tuple(kv.block_ids("a")[:2])
    kv.finish_disk_writes([DiskWriteDone(written=write.keys)])
    kv.begin_step()
    assert kv.take_disk_writes() == []  # once


def test_a_waiting_request_probes_then_loads_its_blocks_from_the_store_into_host_memory() -> None:
    kv = KVCacheManager(8, BLOCK, True, "fp", num_host_blocks=4, disk=True, write_policy="off")
    prompt = _tokens(0, 13)  # three full blocks and one token to compute
    kv.begin_step()
    probe = kv.plan_disk_read("a", prompt)
    assert probe is not None and probe.is_probe and len(probe.keys) == 3
    assert kv.is_loading("a") and kv.plan_disk_read("a", prompt) is None  # one read at a time
    kv.finish_disk_reads([DiskReadDone(probe.read_id, 2, 0.0)])  # the store has the first two
    load = kv.plan_disk_read("a", prompt)
    assert load is not None and not load.is_probe and load.keys == probe.keys[:2] and len(load.dst_ids) == 2
    assert kv.pools[HOST].num_free == 2  # held by the load while it runs (half of host memory at most)
    kv.finish_disk_reads([DiskReadDone(load.read_id, 2, 0.01)])
    assert not kv.is_loading("a")
    assert kv.plan_disk_read("a", prompt) is None  # the store lacks the third block: nothing more
    prefix = kv.find_cached_prefix("a", prompt)
    assert prefix.tiers == [HOST, HOST] and prefix.tokens_by_origin() == {DISK: 8}
    assert kv.counters[DISK].blocks_read == 2


def test_a_load_that_comes_back_short_is_not_retried() -> None:
    kv = KVCacheManager(8, BLOCK, True, "fp", num_host_blocks=8, disk=True, write_policy="off")
    prompt = _tokens(0, 13)
    probe = kv.plan_disk_read("a", prompt)
    assert probe is not None
    kv.finish_disk_reads([DiskReadDone(probe.read_id, 3, 0.0)])
    load = kv.plan_disk_read("a", prompt)
    assert load is not None and len(load.keys) == 3
    kv.finish_disk_reads([DiskReadDone(load.read_id, 1, 0.0)])  # the second block was corrupt
    assert kv.plan_disk_read("a", prompt) is None
    assert kv.find_cached_prefix("a", prompt).num_tokens == 4
    kv.begin_step()
    assert kv.pools[HOST].num_free == 7  # the unused blocks went back; the loaded one is held while a waits
    kv.free("a")
    assert kv.pools[HOST].num_free == 8


def test_the_loader_puts_the_leading_run_that_reads_back_whole_into_host_memory(dict_store: type) -> None:
    _, tiers = _memory(num_blocks=4, host_blocks=4)
    store = dict_store()
    good = torch.full((1, 2, 1, BLOCK, 1), 7.0)
    store.blocks = {b"a": good, b"b": good + 1, b"c": torch.zeros(1, 2, 1, 2 * BLOCK, 1), b"d": good}
    io = TierIO(tiers, store, background=False)
    io.apply([DiskRead(0, (b"a", b"b", b"c", b"d"), (0, 1, 2, 3)), DiskRead(1, (b"a", b"x", b"d"))], [], [])
    report = io.report()
    assert [(r.read_id, r.num_found) for r in report.reads] == [(0, 2), (1, 1)]  # c has another layout
    assert tiers[HOST].read_blocks([0, 1])[0, 0, 0, :, 0, 0].tolist() == [7.0, 8.0]
    assert report.io is not None and report.io.blocks_missing == 2 and report.io.blocks_loaded == 2


def test_writes_that_do_not_fit_the_writers_queue_are_dropped_not_waited_for(
    dict_store: type, gated_store: type
) -> None:
    _, tiers = _memory(num_blocks=8, host_blocks=2)
    store = gated_store(dict_store())
    io = TierIO(tiers, store, write_queue_blocks=3)
    try:
        writes = [DiskWrite(DEVICE, (i,), (bytes([i]),)) for i in range(6)]
        io.apply([], writes, [])  # returns while the writer is stuck on the first
        report = io.report()
        dropped = [k for w in report.writes for k in w.dropped]
        assert len(dropped) == 3 and report.io is not None and report.io.blocks_dropped == 3
        store.release.set()
        io.flush()
        written = [k for w in io.report().writes for k in w.written]
        assert len(written) == 3 and set(store.base.blocks) == set(written)
    finally:
        store.release.set()
        io.close()


def test_a_step_does_not_wait_for_a_slow_read_and_the_read_is_reported_when_done(
    dict_store: type, gated_store: type
) -> None:
    _, tiers = _memory(num_blocks=4, host_blocks=2)
    base = dict_store()
    base.blocks[b"k"] = torch.full((1, 2, 1, BLOCK, 1), 3.0)
    store = gated_store(base)
    io = TierIO(tiers, store)
    try:
        io.apply([DiskRead(5, (b"k",), (1,))], [], [BlockTransfer(BlockRef(DEVICE, 0), BlockRef(HOST, 0))])
        assert io.report(wait_s=0.05).reads == ()  # the copies ran; the read is still in flight
        store.release.set()
        deadline = time.monotonic() + 30
        reads: tuple = ()
        while not reads and time.monotonic() < deadline:
            reads = io.report(wait_s=0.1).reads
        assert [(r.read_id, r.num_found) for r in reads] == [(5, 1)]
        assert float(tiers[HOST].read_blocks([1]).unique()) == 3.0
    finally:
        store.release.set()
        io.close()


def test_a_read_that_fails_its_check_is_reported_with_the_store_stats_that_count_it(dict_store: type) -> None:
    """The report's own ask for the store's stats can be overtaken by a read: a snapshot taken before the read's
    checksum failure must not be what the report that brings the read carries (the failure was then lost to
    ``/metrics`` until the next refresh)."""

    class CheckedStore(dict_store):  # type: ignore[misc, valid-type]
        """Reads of ``b"bad"`` fail their check (counted, as the disk store counts a damaged file). The stats asked
        for outside the loader are taken, then held back until the loader has reported its read (or 0.5 s)."""

        def __init__(self) -> None:
            super().__init__()
            self.failures = 0
            self.go = threading.Event()
            self.io: TierIO | None = None

        def read(self, keys):
            self.go.wait(timeout=30)
            self.failures += keys.count(b"bad")
            return [None if k == b"bad" else v for k, v in zip(keys, super().read(keys), strict=True)]

        def stats(self) -> dict[str, int]:
            taken = {"checksum_failures": self.failures}
            if threading.current_thread().name != "boundless-kv-loader":
                self.go.set()
                deadline = time.monotonic() + 0.5
                while self.io is not None and not self.io._reads_done and time.monotonic() < deadline:
                    time.sleep(0.005)
            return taken

    _, tiers = _memory(num_blocks=4, host_blocks=4)
    store = CheckedStore()
    io = store.io = TierIO(tiers, store)
    try:
        io.apply([DiskRead(7, (b"bad",), (0,))], [], [])
        reads: tuple = ()
        deadline = time.monotonic() + 30
        while not reads and time.monotonic() < deadline:
            report = io.report(wait_s=0.1)
            reads = report.reads
        assert [(r.read_id, r.num_found) for r in reads] == [(7, 0)]
        assert report.io is not None and report.io.store == {"checksum_failures": 1}
    finally:
        store.go.set()
        io.close()


def test_the_loader_runs_a_read_of_a_request_here_before_the_reads_ahead_queued_before_it(
    dict_store: type, gated_store: type
) -> None:
    _, tiers = _memory(num_blocks=4, host_blocks=4)
    base = dict_store()
    for key in (b"a", b"b", b"c", b"d"):
        base.blocks[key] = torch.full((1, 2, 1, BLOCK, 1), 1.0)
    store = gated_store(base)
    io = TierIO(tiers, store)
    try:
        io.apply([DiskRead(1, (b"a",), (0,))], [], [])  # in progress: the loader waits on the store
        io.apply([DiskRead(2, (b"b",), (1,), ahead=True), DiskRead(3, (b"c",), (2,), ahead=True)], [], [])
        io.apply([DiskRead(4, (b"d",), (3,))], [], [])  # a placed call's read, after two reads ahead
        store.release.set()
        io.flush()
        assert [r.read_id for r in io.report().reads] == [1, 4, 2, 3]
    finally:
        store.release.set()
        io.close()


def test_blocks_loaded_for_a_waiting_request_stay_until_its_turn() -> None:
    kv = KVCacheManager(4, BLOCK, True, "fp", num_host_blocks=4, disk=True, write_policy="off")
    prompt = _tokens(0, 9)
    kv.finish_disk_writes([DiskWriteDone(written=tuple(kv.block_hashes("a", prompt)))])
    load = kv.plan_disk_read("a", prompt)
    assert load is not None and len(load.keys) == 2
    kv.finish_disk_reads([DiskReadDone(load.read_id, 2, 0.0)])
    for i in range(3):  # other requests come and go: their blocks are evicted from the device to host memory
        kv.begin_step()
        assert kv.allocate(f"x{i}", _tokens(100 * (i + 1), 16), 16)
        kv.free(f"x{i}")
    prefix = kv.find_cached_prefix("a", prompt)
    assert prefix.tiers == [HOST, HOST] and prefix.tokens_by_origin() == {DISK: 8}
    assert kv.allocate("a", prompt, 9, prefix)
    kv.begin_step()
    assert kv.pools[HOST].num_free == 4  # admitted: the loaded blocks stay as cache, no longer held


def test_prefetches_for_the_queue_take_at_most_half_of_host_memory() -> None:
    kv = KVCacheManager(64, BLOCK, True, "fp", num_host_blocks=8, disk=True, write_policy="off")
    prompts = {rid: _tokens(100 * i, 13) for i, rid in enumerate("abc")}
    for rid, prompt in prompts.items():
        kv.finish_disk_writes([DiskWriteDone(written=tuple(kv.block_hashes(rid, prompt)))])
    loads = [kv.plan_disk_read(rid, prompt) for rid, prompt in prompts.items()]
    assert [len(r.keys) if r else 0 for r in loads] == [3, 1, 0]
    kv.finish_disk_reads([DiskReadDone(r.read_id, len(r.keys), 0.0) for r in loads if r])
    assert kv.plan_disk_read("c", prompts["c"]) is None  # a and b still wait with their blocks
    kv.free("a")  # a leaves: its loaded blocks no longer count
    load = kv.plan_disk_read("c", prompts["c"])
    assert load is not None and len(load.keys) == 3


def test_cache_flags_are_checked_at_start_up() -> None:
    assert CacheConfig().host_gb == 1.0
    assert CacheConfig(swap_space_gb=0.5).host_gb == 0.5 and CacheConfig(kv_host_gb=2).host_gb == 2
    with pytest.raises(ConfigError, match="--swap-space-gb"):
        CacheConfig(kv_host_gb=1, swap_space_gb=2)
    with pytest.raises(ConfigError, match="--kv-write-policy"):
        CacheConfig(kv_write_policy="sometimes")
    with pytest.raises(ConfigError, match="--kv-disk-path"):
        CacheConfig(kv_disk_path="/tmp/x", kv_host_gb=0)
    with pytest.raises(ConfigError, match="--kv-disk-path"):
        CacheConfig(kv_disk_path="/tmp/x", enable_prefix_caching=False)
