"""A run of blocks in one call: the block pool's and the cache manager's batched operations against the same work done a
block at a time, over random pools and prompts (names with other tokens included, so a collision check that a run
skipped would show)."""

from __future__ import annotations

import random

from boundless.kv.block_hash import BlockHash, extend_block_hashes
from boundless.kv.block_pool import BlockPool, KVBlock, find_held, find_run
from boundless.kv.manager import KVCacheManager
from boundless.kv.transfer import DEVICE, HOST

BS = 4


def _names(pool: BlockPool) -> list[tuple[BlockHash | None, tuple[int, ...] | None]]:
    return [(b.block_hash, b.token_ids) for b in pool.blocks]


def _random_pool(rng: random.Random, tokens: list[int], hashes: list[BlockHash]) -> BlockPool:
    """A pool holding some of the prompt's blocks (some under their name with other tokens), some of them in use."""
    pool = BlockPool(len(hashes) + 4)
    blocks = pool.allocate(len(hashes) + 4)
    for i, block in enumerate(blocks[: len(hashes)]):
        roll = rng.random()
        if roll < 0.7:
            pool.cache(block, hashes[i], tokens[i * BS : (i + 1) * BS])
        elif roll < 0.8:
            pool.cache(block, hashes[i], [t + 1 for t in tokens[i * BS : (i + 1) * BS]])  # a name's collision
    pool.free([b for b in blocks if rng.random() < 0.5])
    return pool


def test_a_run_found_across_pools_is_what_lookups_in_turn_find_and_count_and_where_a_gap_ends() -> None:
    rng = random.Random(7)
    for _ in range(600):
        tokens = [rng.randrange(5) for _ in range(BS * rng.randrange(1, 12) + rng.randrange(BS))]
        hashes = extend_block_hashes([], tokens, BS, "fp")
        pools = [_random_pool(rng, tokens, hashes) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.2:
            rng.choice(pools).enable_caching = False  # found by a peek, never counted by a lookup
        first = rng.randrange(len(hashes) + 1)
        end = rng.randrange(first, len(hashes) + 1)
        for count in (False, True):
            before = [(p.stats.queries, p.stats.hits) for p in pools]
            expected = []  # each block in each pool in turn
            for i in range(first, end):
                found = None
                for k, pool in enumerate(pools):
                    get = pool.lookup if count else pool.peek
                    block = get(hashes[i], tokens[i * BS : (i + 1) * BS])
                    if block is not None:
                        found = (block, k)
                        break
                if found is None:
                    break
                expected.append(found)
            one_by_one = [(p.stats.queries - q, p.stats.hits - h) for p, (q, h) in zip(pools, before, strict=True)]
            block_tokens = [tuple(tokens[i * BS : (i + 1) * BS]) for i in range(len(hashes))]
            blocks, where = find_run(pools, hashes, block_tokens, first, end, count=count)
            assert list(zip(blocks, where, strict=True)) == expected
            twice = [(p.stats.queries - q, p.stats.hits - h) for p, (q, h) in zip(pools, before, strict=True)]
            assert twice == [(2 * q, 2 * h) for q, h in one_by_one]
        held = [i for i in range(first, end) if any(p.peek(hashes[i], tokens[i * BS : (i + 1) * BS]) for p in pools)]
        assert find_held(pools, hashes, block_tokens, first, end) == (held[0] if held else end)


def test_a_run_named_names_what_naming_each_block_in_turn_does() -> None:
    rng = random.Random(11)
    for _ in range(400):
        tokens = [rng.randrange(5) for _ in range(BS * rng.randrange(1, 12))]
        hashes = extend_block_hashes([], tokens, BS, "fp")
        seed = rng.random()
        twins = [_random_pool(random.Random(seed), tokens, hashes) for _ in range(2)]
        first = rng.randrange(len(hashes) + 1)
        end = rng.randrange(first, len(hashes) + 1)
        picks = [rng.randrange(len(twins[0].blocks)) for _ in range(end - first)]  # a block may come twice
        run: list[KVBlock] = [twins[0].blocks[p] for p in picks]
        twins[0].cache_run(run, hashes, [tuple(tokens[i * BS : (i + 1) * BS]) for i in range(len(hashes))], first)
        for i, p in zip(range(first, end), picks, strict=True):
            twins[1].cache(twins[1].blocks[p], hashes[i], tokens[i * BS : (i + 1) * BS])
        assert _names(twins[0]) == _names(twins[1])
        twins[0].check_invariants()


def _manager_with_history(rng: random.Random, prompts: list[list[int]]) -> KVCacheManager:
    """A manager with a small device and host memory, after random requests came and went (evictions demote blocks
    to host memory, and host memory evicts in turn)."""
    kv = KVCacheManager(12, BS, True, "fp", num_host_blocks=6)
    for n in range(30):
        rid = f"old{n}"
        tokens = rng.choice(prompts)[: rng.randrange(2, 40)]
        kv.begin_step()
        if kv.allocate(rid, tokens, len(tokens), kv.find_cached_prefix(rid, tokens)):
            if rng.random() < 0.7:
                kv.free(rid)
        else:
            kv.free(rid)
    return kv


def test_a_cached_prefix_is_each_block_on_the_device_else_in_host_memory() -> None:
    rng = random.Random(3)
    for _ in range(150):
        prompts = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
        kv = _manager_with_history(rng, prompts)
        tokens = rng.choice(prompts)[: rng.randrange(1, 41)]
        hashes = extend_block_hashes([], tokens, BS, "fp")
        device, host = kv.pool, kv.pools[HOST]
        counts = (device.stats.queries, device.stats.hits, host.stats.queries, host.stats.hits)
        expected = []  # a block at a time: the device, else host memory
        for i in range((len(tokens) - 1) // BS):
            block, tier = device.lookup(hashes[i], tokens[i * BS : (i + 1) * BS]), DEVICE
            if block is None:
                block, tier = host.lookup(hashes[i], tokens[i * BS : (i + 1) * BS]), HOST
            if block is None:
                break
            expected.append((block, tier))
        one_by_one = [
            s - c
            for s, c in zip(
                (device.stats.queries, device.stats.hits, host.stats.queries, host.stats.hits), counts, strict=True
            )
        ]
        prefix = kv.find_cached_prefix("new", tokens)
        assert list(zip(prefix.blocks, prefix.tiers, strict=True)) == expected
        after = (device.stats.queries, device.stats.hits, host.stats.queries, host.stats.hits)
        assert [a - c - o for a, c, o in zip(after, counts, one_by_one, strict=True)] == one_by_one
        refs = kv.memory_prefix(None, tokens, len(tokens) // BS)
        assert len(refs) >= len(expected)
        assert [(r.tier, r.block_id) for r in refs[: len(expected)]] == [(t, b.block_id) for b, t in expected]


def test_a_programs_next_request_takes_the_names_its_last_one_had_for_the_blocks_they_share() -> None:
    """A conversation sent again (longer, compacted, or in another namespace): its names are those hashed afresh, and
    its lookups find what a manager that hashes every request afresh finds."""
    rng = random.Random(5)
    for _ in range(40):
        kv, fresh = KVCacheManager(64, BS, True, "fp"), KVCacheManager(64, BS, True, "fp")  # fresh: no programs
        conversation = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        for call in range(6):
            rid = f"r{call}"
            kv.set_program(rid, "p")
            namespace = rng.random() < 0.2
            if namespace:
                kv.set_namespace(rid, "fp-lora")
                fresh.set_namespace(rid, "fp-lora")
            prefix = kv.find_cached_prefix(rid, conversation)
            expected = fresh.find_cached_prefix(rid, conversation)
            assert kv.block_hashes(rid, conversation) == extend_block_hashes(
                [], conversation, BS, "fp-lora" if namespace else "fp"
            )
            assert [b.block_id for b in prefix.blocks] == [b.block_id for b in expected.blocks]
            for manager, found in ((kv, prefix), (fresh, expected)):
                assert manager.allocate(rid, conversation, len(conversation), found)
                manager.end_request(rid)
            roll = rng.random()
            if roll < 0.2:  # compacted: its head kept, a block's worth of its tail dropped
                conversation = conversation[:BS] + conversation[2 * BS :]
            elif roll < 0.3:  # another turn of the same tokens changed
                conversation = [t + 1 for t in conversation]
            conversation = conversation + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]


def test_a_programs_taken_names_through_preemptions_swaps_resets_and_host_memory() -> None:
    """The names a program's requests take (their program's latest request's) through what a served request goes
    through: recomputed after a preemption (freed, not ended), swapped out and in, the prefix cache reset, host memory
    below the device, namespaces (an adapter's, a salt's) changing from call to call of one program. Its names are
    those hashed afresh, and it finds, holds and counts what a manager of requests without programs does."""
    rng = random.Random(13)
    for _ in range(60):
        device, host = rng.choice([12, 24]), rng.choice([0, 8, 24])
        managers = [KVCacheManager(device, BS, True, "fp", num_host_blocks=host) for _ in range(2)]
        kv, fresh = managers  # fresh: no programs
        tokens: dict[str, list[int]] = {}
        state: dict[str, str] = {}
        namespace: dict[str, str] = {}
        last: dict[str, list[int]] = {}
        program: dict[str, str] = {}
        for n in range(80):
            for manager in managers:
                manager.begin_step()
            roll = rng.random()
            if roll < 0.25 or not tokens:
                rid = f"r{n}"
                program[rid] = rng.choice("ab")
                base = list(last.get(program[rid], []))
                if rng.random() < 0.2 and len(base) > 2 * BS:  # compacted
                    base = base[:BS] + base[2 * BS :]
                tokens[rid] = base + [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
                state[rid] = "waiting"
                kv.set_program(rid, program[rid])
                if rng.random() < 0.3:
                    namespace[rid] = rng.choice(["lora", "salt"])
                    for manager in managers:
                        manager.set_namespace(rid, namespace[rid])
                continue
            rid = rng.choice(sorted(tokens))
            ids = tokens[rid]
            if state[rid] == "waiting":
                found = [m.find_cached_prefix(rid, ids) for m in managers]
                assert kv.block_hashes(rid, ids) == extend_block_hashes([], ids, BS, namespace.get(rid, "fp"))
                assert [[(b.block_id, t) for b, t in zip(p.blocks, p.tiers, strict=True)] for p in found] == [
                    [(b.block_id, t) for b, t in zip(found[0].blocks, found[0].tiers, strict=True)]
                ] * 2
                admitted = {m.allocate(rid, ids, len(ids), p) for m, p in zip(managers, found, strict=True)}
                assert len(admitted) == 1
                if admitted.pop():
                    state[rid] = "running"
            elif state[rid] == "running" and roll < 0.6:
                ids.append(rng.randrange(3))
                assert len({m.allocate(rid, ids, len(ids)) for m in managers}) == 1  # both grew it, or neither
            elif state[rid] == "running" and roll < 0.7:
                swapped = [m.swap_out(rid) for m in managers]
                assert (swapped[0] is None) == (swapped[1] is None)
                state[rid] = "running" if swapped[0] is None else "swapped"
            elif state[rid] == "swapped":
                back = [m.swap_in(rid, ids, len(ids)) for m in managers]
                assert (back[0] is None) == (back[1] is None)
                state[rid] = "swapped" if back[0] is None else "running"
            elif roll < 0.8:  # preempted: recomputed later
                for manager in managers:
                    manager.free(rid)
                state[rid] = "waiting"
            elif roll < 0.83:
                for manager in managers:
                    manager.reset_prefix_cache()
            else:
                for manager in managers:
                    manager.end_request(rid)
                last[program[rid]] = ids
                del tokens[rid], state[rid]
                namespace.pop(rid, None)
            for tier, pool in kv.pools.items():
                pool.check_invariants()
                other = fresh.pools[tier]
                assert (pool.num_free, pool.stats.queries, pool.stats.hits) == (
                    other.num_free,
                    other.stats.queries,
                    other.stats.hits,
                )
