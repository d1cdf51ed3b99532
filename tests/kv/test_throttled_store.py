"""A store whose reads wait for an emulated storage link: the bytes read cross the link, probes and misses
cost nothing."""

from __future__ import annotations

import torch

from boundless.cluster.links import Link, ThrottledLink
from boundless.kv.throttled_store import ThrottledStore


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
