"""Whatever the scheduler decides, a request's KV is always its own, in every tier.

A stand-in for the model writes each token's id into its KV slot; before every chunk runs we read
back, through the chunk's block table, the KV of every position before it and check that it holds
the request's tokens. After every step, every named block of the device, of host memory and of the disk
store holds the tokens its name stands for. The real scheduler, KV manager, paged cache, host tier and the
executor's move path (``TierIO``: transfers, the store's reads and writes) run under priorities that
reshuffle every step, a KV pool too small for everyone and a small host pool, so that swaps out and in,
recomputes, evictions down the tiers, prefix hits in every tier and loads from the store meet in one step.
Each configuration runs with LRU eviction and with program-aware eviction under eviction keys that are also
redrawn every step (``ShufflingRanking``), so that blocks are re-keyed in every tier all the time.

The disk store here is a dict (conftest's ``DictStore``, the ``BlockStore`` interface): the persistent store
(``kv/disk_store.py``) is built on another branch and plugs in behind the same interface. Reads and writes
run in the test's thread (``TierIO(background=False)``) and their reports reach the scheduler after a random
number of steps, so that requests wait for loads across steps, deterministically for a seed.
"""

from __future__ import annotations

import atexit
import functools
import math
import random
import shutil
import tempfile
from collections.abc import Callable

import pytest
import torch

from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from boundless.kv.block_hash import BlockHash, extend_block_hashes
from boundless.kv.disk_moves import TierReport
from boundless.kv.disk_store import DiskKVStore, StoreLayout
from boundless.kv.eviction import FINISHED, ChangeFeeds, EvictionKey
from boundless.kv.manager import KVCacheManager
from boundless.kv.tensors import PagedKVCache
from boundless.kv.tier_io import TierIO
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import DEVICE, DISK, HOST
from boundless.programs.ref import ProgramRef

BLOCK = 4


class RealStore(DiskKVStore):
    """The persistent store on a fresh temporary directory, shaped like the stand-in model's KV (one layer, one
    head of one dimension), with files that do not go away before the process ends."""

    def __init__(self) -> None:
        layout = StoreLayout("fp", num_layers=1, num_kv_heads=1, block_size=BLOCK, head_dim=1, dtype=torch.float32)
        path = tempfile.mkdtemp(prefix="kv-integrity-")
        atexit.register(shutil.rmtree, path, True)
        super().__init__(path, layout, 1 << 30, io_threads=2)


class ShufflingPolicy:
    """A fresh random order every step: the worst case for keeping KV in place."""

    name = "shuffle"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.keys: dict[str, float] = {}

    def on_arrival(self, request: Request, now: float) -> None:
        pass

    def update(self, now: float) -> None:
        self.keys.clear()

    def priority(self, request: Request, now: float) -> tuple:
        return (self.keys.setdefault(request.request_id, self.rng.random()),)

    def on_service(self, request: Request, service_s: float, now: float) -> None:
        pass

    def on_finish(self, request: Request, now: float) -> None:
        pass


class ShufflingRanking:
    """Program-aware eviction keys drawn at random and redrawn every step (every program reported changed),
    some programs finished, some keys holding only until a near clock time: the worst case for the re-keying of
    free blocks."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.clock = 0.0
        self.keys: dict[str, tuple[EvictionKey, float]] = {}
        self._feeds = ChangeFeeds()

    def eviction_key(self, program_id: str) -> tuple[EvictionKey, float]:
        held = self.keys.get(program_id)
        if held is None or held[1] <= self.clock:
            key = FINISHED if self.rng.random() < 0.2 else (1.0, float(self.rng.randrange(4)))
            until = self.clock + self.rng.randint(1, 3) if self.rng.random() < 0.3 else math.inf
            held = self.keys[program_id] = (key, until)
        return held

    def now(self) -> float:
        return self.clock

    def subscribe(self) -> Callable[[], set[str]]:
        return self._feeds.subscribe()

    def reshuffle(self) -> None:
        self.clock += 1.0
        self._feeds.publish(self.keys)
        self.keys.clear()


def _run_chunks(cache: PagedKVCache, out: SchedulerOutput, requests: dict[str, Request]) -> None:
    """Check the KV before each chunk, then write the chunk's tokens as its KV."""
    keys, _ = cache.layer(0)
    for chunk in out.chunks:
        tokens = requests[chunk.request_id].all_token_ids
        for pos in range(chunk.start_pos):
            block, slot = chunk.block_ids[pos // BLOCK], pos % BLOCK
            held = int(keys[0, block, slot, 0].item()) - 1  # never-written memory reads as -1
            assert held == tokens[pos], f"{chunk.request_id} position {pos}: KV of token {held}, not {tokens[pos]}"
        for i, token in enumerate(chunk.token_ids):
            pos = chunk.start_pos + i
            keys[0, chunk.block_ids[pos // BLOCK], pos % BLOCK, 0] = float(token + 1)


def _held_tokens(block_kv: torch.Tensor) -> tuple[int, ...]:
    """The tokens a block's KV stands for: [layers, 2, kv_heads, block_size, head_dim] as the stand-in wrote it."""
    return tuple(int(v) - 1 for v in block_kv[0, 0, 0, :, 0].tolist())


def _check_named_blocks(kv: KVCacheManager, tiers: dict, store, names: dict) -> None:
    """Every named block, in every tier, holds the tokens of its name."""
    for tier, pool in kv.pools.items():
        for block in pool.blocks:
            if block.block_hash is not None:
                held = _held_tokens(tiers[tier].read_blocks([block.block_id])[:, :, :, 0])
                assert held == block.token_ids, f"{tier} block {block.block_id}: KV of {held}, named {block.token_ids}"
    for key, kv_block in getattr(store, "blocks", {}).items():  # the stand-in store; the real one at the end
        assert _held_tokens(kv_block) == names[key], "a block in the store holds another block's KV"


def _check_stored_blocks(store: DiskKVStore, names: dict) -> None:
    """Every block in the real store's files holds the tokens of its name (read back as a load reads it)."""
    keys = store.held_keys()
    out = torch.empty((len(keys), *store.layout.block_shape))
    assert all(store.read_into(keys, out)) and store.stats().checksum_failures == 0
    for key, block in zip(keys, out, strict=True):
        assert _held_tokens(block) == names[key], "a block in the store holds another block's KV"


def _merge(reports: list[TierReport]) -> TierReport:
    return TierReport(
        tuple(r for rep in reports for r in rep.reads), tuple(w for rep in reports for w in rep.writes), None
    )


@functools.cache  # each configuration runs once, for both tests below
def _simulate(seed: int, store_cls: type | None, eviction: str = "lru") -> tuple[SchedulerStats, object]:
    """Eighteen requests of five programs, many sharing prefixes or coming back to earlier conversations, through
    a 14-block pool; returns the scheduler's stats and the store."""
    rng = random.Random(seed)
    disk = store_cls is not None
    num_blocks, host_blocks = 14, rng.choice([3, 6, 40])
    policy = rng.choice(["through", "back", "off"]) if disk else "off"
    ranking = ShufflingRanking(random.Random(seed + 1000)) if eviction == "program" else None
    kv = KVCacheManager(
        num_blocks, BLOCK, True, "fp", num_host_blocks=host_blocks, disk=disk, write_policy=policy, ranking=ranking
    )  # fmt: skip
    cache = PagedKVCache(1, 1, 1, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    tiers = {DEVICE: cache, HOST: HostKVTier(cache, host_blocks)}
    store = store_cls() if store_cls is not None else None
    io = TierIO(tiers, store, write_queue_blocks=rng.choice([2, 64]), background=False)
    sched = Scheduler(kv, ShufflingPolicy(rng), lambda: 0.0, max_num_batched_tokens=12, max_num_seqs=5)
    shared = [rng.randrange(1000) for _ in range(2 * BLOCK)]
    finished: list[list[int]] = []  # conversations that ended, for later calls to come back to
    names: dict[BlockHash, tuple[int, ...]] = {}
    held_back: list[TierReport] = []

    def new_request(i: int) -> Request:
        if finished and rng.random() < 0.5:
            prompt = rng.choice(finished) + [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
        else:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)
        program = ProgramRef(f"p{rng.randrange(5)}")
        return Request(f"r{i}", prompt[:40], params, arrival_time=float(i), program=program)

    next_id = 0
    for _ in range(3000):
        if next_id < 18 and rng.random() < 0.3:
            sched.add(new_request(next_id))
            next_id += 1
        if next_id >= 18 and not sched.requests and not kv.num_reads_in_flight:
            break
        if ranking is not None:
            ranking.reshuffle()
        out = sched.schedule()
        io.apply(out.disk_reads, out.disk_writes, out.transfers, out.disk_ages)  # as the model executor does
        _run_chunks(cache, out, sched.requests)
        sched.advance(out, service_s=0.01)
        held_back.append(io.report())
        if rng.random() < 0.5:  # the background I/O reports late, by a random number of steps
            sched.apply_tier_report(_merge(held_back))
            held_back = []
        for request in sched.requests.values():  # what each name stands for, for the check below
            tokens = request.all_token_ids
            for i, name in enumerate(extend_block_hashes([], tokens, BLOCK, "fp")):
                names[name] = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        for chunk in out.chunks:
            request = sched.requests[chunk.request_id]
            if chunk.sample:
                request.append_output(rng.randrange(1000))
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    sched.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
                    finished.append(list(request.all_token_ids))
        _check_named_blocks(kv, tiers, store, names)
        kv.pool.check_invariants()
    assert not sched.requests, "every request finishes"
    sched.apply_tier_report(_merge([*held_back, io.report()]))
    kv.begin_step()
    assert kv.num_reads_in_flight == 0
    assert kv.pools[HOST].num_free == host_blocks, "host blocks leaked"
    kv.pools[HOST].check_invariants()
    if isinstance(store, DiskKVStore):
        _check_stored_blocks(store, names)
    return sched.stats, store


SEEDS = range(40)
EVICTIONS = ("lru", "program")


@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_kv_survives_swaps_recomputes_and_shared_prefixes(seed: int, eviction: str) -> None:
    _simulate(seed, None, eviction)


@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_kv_survives_every_tier_with_a_disk_store(seed: int, eviction: str, dict_store: type) -> None:
    _simulate(seed, dict_store, eviction)


@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("seed", SEEDS[:12])
def test_kv_survives_every_tier_with_the_persistent_store(seed: int, eviction: str) -> None:
    _simulate(seed, RealStore, eviction)


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_the_runs_exercise_every_kind_of_preemption_and_every_tier(eviction: str, dict_store: type) -> None:
    stats = [_simulate(seed, store, eviction)[0] for seed in SEEDS for store in (None, dict_store)]
    assert sum(s.num_swapped_out for s in stats) > 0 and sum(s.num_swapped_in for s in stats) > 0
    assert sum(s.num_recomputed for s in stats) > 0
    for tier in (DEVICE, HOST, DISK):
        assert sum(s.cached_tokens_by_tier.get(tier, 0) for s in stats) > 0, f"no prefix came from {tier}"
    from_files = [_simulate(seed, RealStore, eviction)[0].cached_tokens_by_tier.get(DISK, 0) for seed in SEEDS[:12]]
    assert sum(from_files) > 0, "no prefix came from the persistent store's files"
    if eviction == "program":  # finished programs' names were aged in the store
        assert sum(len(_simulate(seed, dict_store, eviction)[1].aged) for seed in SEEDS) > 0


def test_host_blocks_a_swap_in_reads_are_not_reused_in_the_same_step() -> None:
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False, fingerprint="fp", num_host_blocks=2)
    a, b = list(range(4)), list(range(100, 108))  # one block and two blocks
    assert kv.allocate("a", a, 4) and kv.allocate("b", b, 8)
    out_a = kv.swap_out("a")
    assert out_a is not None and [(t.src.tier, t.dst.tier) for t in out_a] == [(DEVICE, HOST)]
    kv.begin_step()
    into_a = kv.swap_in("a", a, 4)  # reads a's host block during this step's copies
    out_b = kv.swap_out("b")  # so b may not take it: with one host block free, b does not fit
    assert into_a is not None and out_b is None
    kv.begin_step()
    out_b = kv.swap_out("b")  # next step it is free again
    assert out_b is not None and {t.dst for t in out_b} >= {t.src for t in into_a}
