"""Whatever the scheduler decides, a request's KV is always its own.

A stand-in for the model writes each token's id into its KV slot; before every chunk runs we read
back, through the chunk's block table, the KV of every position before it and check that it holds
the request's tokens. The real scheduler, KV manager, paged cache, host tier and the executor's
transfer path run under priorities that reshuffle every step, a KV pool too small for everyone and
a small host pool, so that swaps out and in, recomputes and prefix-cache hits meet in one step.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from boundless.kv.manager import KVCacheManager
from boundless.kv.tensors import PagedKVCache
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import DEVICE, HOST, apply_transfers

BLOCK = 4


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


@functools.cache  # each seed runs once, for both tests below
def _simulate(seed: int) -> SchedulerStats:
    """Fourteen requests, half sharing a prefix, through a 14-block pool; returns the scheduler's stats."""
    rng = random.Random(seed)
    num_blocks, host_blocks = 14, rng.choice([3, 6, 40])
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True, fingerprint="fp", num_host_blocks=host_blocks)
    cache = PagedKVCache(1, 1, 1, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    tiers = {DEVICE: cache, HOST: HostKVTier(cache, host_blocks)}
    sched = Scheduler(kv, ShufflingPolicy(rng), lambda: 0.0, max_num_batched_tokens=12, max_num_seqs=5)
    shared = [rng.randrange(1000) for _ in range(2 * BLOCK)]
    pending = []
    for i in range(14):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)
        pending.append(Request(f"r{i}", prompt, params, arrival_time=float(i)))
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        if not pending and not sched.requests:
            break
        out = sched.schedule()
        apply_transfers(out.transfers, tiers)  # as the model executor does, before the forward pass
        _run_chunks(cache, out, sched.requests)
        sched.advance(out, service_s=0.01)
        for chunk in out.chunks:
            request = sched.requests[chunk.request_id]
            if chunk.sample:
                request.append_output(rng.randrange(1000))
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    sched.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        kv.pool.check_invariants()
    assert not pending and not sched.requests, "every request finishes"
    kv.begin_step()
    assert kv.pools[HOST].num_free == host_blocks, "host blocks leaked"
    kv.pools[HOST].check_invariants()
    return sched.stats


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_kv_survives_swaps_recomputes_and_shared_prefixes(seed: int) -> None:
    _simulate(seed)


def test_the_runs_exercise_every_kind_of_preemption() -> None:
    stats = [_simulate(seed) for seed in SEEDS]
    assert sum(s.num_swapped_out for s in stats) > 0 and sum(s.num_swapped_in for s in stats) > 0
    assert sum(s.num_recomputed for s in stats) > 0
    assert sum(s.num_prompt_tokens_cached for s in stats) > 0


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
