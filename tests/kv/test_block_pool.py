"""Property-based test of the block pool and KV cache manager: no leaks, no double frees, consistent counts."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from boundless.kv.block_hash import extend_block_hashes, hash_block
from boundless.kv.block_pool import BlockPool, NoFreeBlocksError
from boundless.kv.manager import KVCacheManager

BLOCK = 4
NUM_BLOCKS = 24


class KVManagerMachine(RuleBasedStateMachine):
    """Requests arrive with random prompts drawn from a few shared prefixes, grow, get preempted and finish."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True, fingerprint="test")
        self.tokens: dict[str, list[int]] = {}  # live requests and their tokens
        self.computed: dict[str, int] = {}  # tokens with KV (0 when preempted)
        self.next_id = 0

    @rule(
        prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
        tail=st.lists(st.integers(0, 5), max_size=9),
    )
    def arrive(self, prefix: list[int], tail: list[int]) -> None:
        tokens = prefix + tail
        if not tokens:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.tokens[rid] = tokens
        self.computed[rid] = 0

    @precondition(lambda self: any(c == 0 for c in self.computed.values()))
    @rule(data=st.data())
    def admit(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, c in self.computed.items() if c == 0)))
        tokens = self.tokens[rid]
        prefix = self.kv.find_cached_prefix(rid, tokens)
        assert prefix.num_tokens < len(tokens)  # one token is always left to compute
        for i, block in enumerate(prefix.blocks):  # a hit holds exactly the tokens asked for
            assert block.token_ids == tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        free_before = self.kv.pool.num_free
        if self.kv.allocate(rid, tokens, len(tokens), prefix):
            self.computed[rid] = len(tokens)
            assert self.kv.num_allocated_blocks(rid) == self.kv.blocks_for_tokens(len(tokens))
        else:
            assert self.kv.pool.num_free == free_before  # a failed allocation changes nothing
            self.kv.free(rid)

    @precondition(lambda self: any(c > 0 for c in self.computed.values()))
    @rule(data=st.data(), token=st.integers(0, 5))
    def append(self, data, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, c in self.computed.items() if c > 0)))
        self.tokens[rid].append(token)
        if self.kv.allocate(rid, self.tokens[rid], len(self.tokens[rid])):
            self.computed[rid] = len(self.tokens[rid])
        else:
            self.preempt_one(rid)

    def preempt_one(self, rid: str) -> None:
        self.kv.free(rid)
        self.computed[rid] = 0

    @precondition(lambda self: any(c > 0 for c in self.computed.values()))
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self.preempt_one(data.draw(st.sampled_from(sorted(r for r, c in self.computed.items() if c > 0))))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid]

    @invariant()
    def consistent(self) -> None:
        pool = self.kv.pool
        pool.check_invariants()
        # Reference counts equal the number of live block tables holding each block.
        holders = [0] * NUM_BLOCKS
        for rid, c in self.computed.items():
            if c > 0:
                for b in self.kv.block_ids(rid):
                    holders[b] += 1
        made = len(pool.blocks)  # the blocks handed out so far: none after them is held
        assert [b.ref_count for b in pool.blocks] == holders[:made] and not any(holders[made:])
        # No leak: every block is either held or free.
        assert pool.num_free == sum(1 for h in holders if h == 0)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.kv.free(rid)
        assert self.kv.pool.num_free == NUM_BLOCKS


TestKVManager = KVManagerMachine.TestCase
TestKVManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_free_queue_is_lru_and_eviction_reuses_blocks() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"ha", [1])
    pool.cache(b, b"hb", [2])
    pool.free([b])
    pool.free([a])
    pool.free([c])
    # b was freed first, so it is evicted first; its name goes with it.
    (first,) = pool.allocate(1)
    assert first is b and b.block_hash is None and pool.lookup(b"hb", [2]) is None
    assert pool.lookup(b"ha", [1]) is a  # still cached, revivable
    assert pool.stats.evictions == 1


def test_hit_checks_token_ids() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h", [1, 2])
    assert pool.lookup(b"h", [1, 2]) is a
    assert pool.lookup(b"h", [1, 3]) is None  # same name, other tokens: a collision is not a hit


def test_double_free_and_overallocation_raise() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)


def test_shared_prefix_is_found_and_counted() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, fingerprint="m")
    first = list(range(10))
    assert kv.allocate("a", first, len(first), kv.find_cached_prefix("a", first))
    second = first[:8] + [99, 98, 97]
    prefix = kv.find_cached_prefix("b", second)
    assert prefix.num_tokens == 8
    assert kv.allocate("b", second, len(second), prefix)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert [kv.pool.blocks[i].ref_count for i in kv.block_ids("a")[:2]] == [2, 2]


def test_block_names_chain_and_include_the_model() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    names = extend_block_hashes([], tokens, 4, "m")
    assert len(names) == 2
    assert names[0] == hash_block(None, tokens[:4], "m")
    assert names[1] == hash_block(names[0], tokens[4:], "m")
    # The same block after another prefix, or under another model, has another name.
    assert hash_block(None, tokens[4:], "m") != names[1]
    assert extend_block_hashes([], tokens, 4, "other") != names


def test_block_names_keep_their_layout() -> None:
    """Names are kept in the disk store: each is blake2b (16 bytes) of the parent's name, the fingerprint and the
    tokens as native int64s, however they are packed and hashed."""
    rng = random.Random(5)
    for _ in range(200):
        tokens = [rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(0, 50))]
        expected, parent = [], b"\x00" * 16
        for i in range(len(tokens) // 4):
            packed = array("q", tokens[i * 4 : (i + 1) * 4]).tobytes()
            parent = hashlib.blake2b(parent + b"fp" + packed, digest_size=16).digest()
            expected.append(parent)
        assert extend_block_hashes([], tokens, 4, "fp") == expected
        parents = [None, *expected]
        assert [hash_block(parents[i], tokens[i * 4 : (i + 1) * 4], "fp") for i in range(len(expected))] == expected
    # One name written down: a layout that changed would lose every store written before.
    assert hash_block(None, [1, 2, 3, 4], "m").hex() == "532121ac89a1ab149c0421dbb172c1d1"
