"""A model whose every layer slides: a request's blocks that have left the window go back to the pool, named, and
its table starts past them (``KVCacheManager.release_outside_window``)."""

from __future__ import annotations

from boundless.kv.manager import KVCacheManager, LentSpan

BLOCK = 4


def _tokens(n: int) -> list[int]:
    return list(range(100, 100 + n))


def test_blocks_the_window_has_left_go_back_named_and_the_table_starts_past_them() -> None:
    kv = KVCacheManager(8, BLOCK, True, "fp")
    kv.window = 6
    tokens = _tokens(30)
    assert kv.allocate("r", tokens, 22)  # blocks 0..5
    ids = kv.block_ids("r")
    # A query at 22 sees keys 17..22: blocks 0..3 (keys 0..15) have left its window; block 4 holds key 17.
    assert kv.release_outside_window("r", 22) == 4
    assert kv.first_local_block("r") == 4 and kv.remote_prefix("r") == (4, ())
    assert kv.block_ids("r") == ids[4:]
    assert kv.pool.num_free == 8 - 2
    assert kv.release_outside_window("r", 22) == 0  # (nothing more until it moves on)
    # Growing counts the blocks given back: up to 30 tokens is blocks 6 and 7, two new ones.
    assert kv.allocate("r", tokens, 30) and kv.block_ids("r")[:2] == ids[4:6] and len(kv.block_ids("r")) == 4
    assert kv.blocks_short("r", 30) <= 0
    # The blocks given back stay named: another request with the same prefix finds them.
    assert kv.find_cached_prefix("s", tokens[:20]).num_tokens == 16
    kv.free("r")
    assert kv.pool.num_free == 8 and kv.first_local_block("r") == 0


def test_the_last_local_block_stays_and_without_a_window_nothing_goes() -> None:
    kv = KVCacheManager(8, BLOCK, True, "fp")
    assert kv.allocate("r", _tokens(12), 12)
    assert kv.release_outside_window("r", 12) == 0  # (no window: every layer reads every block)
    kv.window = 1
    # A query at 12 sees key 12 alone: blocks 0..2 are behind it, but the last local block (2) is where new KV goes.
    assert kv.release_outside_window("r", 12) == 2
    assert len(kv.block_ids("r")) == 1 and kv.first_local_block("r") == 2
    assert kv.allocate("r", _tokens(16), 16)
    assert len(kv.block_ids("r")) == 2


def test_a_request_swapped_out_past_its_window_swaps_its_local_blocks_only() -> None:
    kv = KVCacheManager(6, BLOCK, True, "fp", num_host_blocks=4)
    kv.window = 5
    tokens = _tokens(24)
    assert kv.allocate("r", tokens, 20) and kv.release_outside_window("r", 20) == 4
    local = kv.block_ids("r")
    assert len(kv.swap_out("r") or []) == 1 == kv.num_swapped_blocks("r")
    assert kv.pool.num_free == 6
    assert len(kv.swap_in("r", tokens, 20) or []) == 1
    assert kv.first_local_block("r") == 4 and len(kv.block_ids("r")) == len(local)
    assert kv.allocate("r", tokens, 24) and len(kv.block_ids("r")) == 2  # (growing from block 5 on)


def test_a_creditors_moves_with_anothers_between_are_two_runs_of_keys() -> None:
    """KV lending's remote prefix: grouped by creditor, each move's keys where they lie among the remote ones, so a
    sliding window's positions count from each run's first key."""
    kv = KVCacheManager(16, BLOCK, True, "fp")
    assert kv.allocate("r", _tokens(40), 40)
    for creditor, move_id, blocks in (("a", "m0", 2), ("b", "m1", 1), ("a", "m2", 2)):
        kv.lend_leading_blocks("r", LentSpan(creditor, move_id, blocks))
    first, remote = kv.remote_prefix("r")
    assert first == 5 and [(r.creditor, r.move_ids, r.num_tokens) for r in remote] == [
        ("a", ("m0", "m2"), 16), ("b", ("m1",), 4),
    ]  # fmt: skip
    assert remote[0].runs(0) == [(("m0",), 0, 8), (("m2",), 12, 8)] and remote[1].runs(16) == [(("m1",), 8, 4)]


def test_a_prefix_is_taken_from_the_window_of_the_next_token_on() -> None:
    """An admission takes a cached prefix's blocks from its next token's window on: the ones before are not held,
    and the table starts past them."""
    kv = KVCacheManager(8, BLOCK, True, "fp")
    kv.window = 5
    tokens = _tokens(40)
    assert kv.allocate("a", tokens, 24)
    kv.free("a")  # its 6 blocks named, free
    found = kv.find_cached_prefix("c", tokens[:30])
    assert found.num_tokens == 24 and found.skipped == 0
    windowed = kv.window_prefix(found)
    assert windowed.skipped == 5 and kv.window_prefix(windowed) is windowed  # (a query at 24 sees keys 20..24)
    assert kv.blocks_short("c", 28, windowed) == 2 - 8  # block 5 and a new one, of 8 free
    assert kv.allocate("c", tokens, 28, windowed)
    assert kv.first_local_block("c") == 5 and len(kv.block_ids("c")) == 2
    assert kv.block_ids("c")[0] == found.blocks[5].block_id
    assert kv.pool.num_free == 6 and all(b.ref_count == 0 for b in found.blocks[:5])
