"""Rank 0's account of the disk store's loads on a model split over ranks: a load is reported once every rank's share
is done, found as far as every rank found; probes are rank 0's alone."""

from __future__ import annotations

from boundless.kv.disk_moves import DiskRead, DiskReadDone
from boundless.kv.split_reads import SplitReads

KEYS = (b"a" * 16, b"b" * 16, b"c" * 16)


def test_a_load_is_done_once_every_rank_is_and_found_as_far_as_every_rank_found() -> None:
    reads = SplitReads(ranks=2)
    load, probe = DiskRead(1, KEYS, (10, 11, 12)), DiskRead(2, KEYS)
    assert reads.expect([load, probe]) == [load]  # the other ranks run the load only
    reads.rank_done(2, DiskReadDone(1, 1, 0.5))  # (a rank may finish before rank 0)
    # Rank 0's probe passes at once; its load waits for rank 1.
    assert reads.agree([DiskReadDone(1, 3, 0.1), DiskReadDone(2, 3, 0.0)]) == [DiskReadDone(2, 3, 0.0)]
    assert reads.waiting
    assert reads.agree([]) == []
    reads.rank_done(1, DiskReadDone(1, 2, 0.2))
    assert reads.agree([]) == [DiskReadDone(1, 1, 0.5)]  # the least found, the slowest rank's seconds
    assert not reads.waiting


def test_loads_are_reported_in_the_order_rank_0_finished_them_as_each_is_agreed() -> None:
    reads = SplitReads(ranks=1)
    reads.expect([DiskRead(1, KEYS, (1, 2, 3)), DiskRead(2, KEYS[:1], (4,))])
    assert reads.agree([DiskReadDone(2, 1, 0.0), DiskReadDone(1, 3, 0.0)]) == []
    reads.rank_done(1, DiskReadDone(1, 3, 0.0))
    assert reads.agree([]) == [DiskReadDone(1, 3, 0.0)]  # (the first agreed goes; the other still waits)
    reads.rank_done(1, DiskReadDone(2, 0, 0.0))
    reads.rank_done(1, DiskReadDone(9, 1, 0.0))  # (one never sent: a failed step's, ignored)
    assert reads.agree([]) == [DiskReadDone(2, 0, 0.0)]
