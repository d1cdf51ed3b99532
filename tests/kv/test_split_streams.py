"""Rank 0's account of a split model's block streams (``kv/split_streams.py``): a stream is reported once every rank's
share is done, valid as far as every rank's, failed if any rank's failed, in the order rank 0 finished them; a counted
receive is counted once every rank's count came; and a receive's gates stay on each rank until rank 0 has reported it
(a real ``RemoteIO`` over a transport the test lands by hand)."""

from __future__ import annotations

import time

import pytest
import torch

from boundless.engine.executor import split_landing
from boundless.kv.layer_gate import LayerLost
from boundless.kv.remote_io import RemoteIO
from boundless.kv.remote_moves import (
    RemoteIOStats,
    RemoteRecv,
    RemoteRecvCount,
    RemoteRecvDone,
    RemoteReport,
    RemoteSend,
    RemoteSendDone,
)
from boundless.kv.split_streams import SplitStreams
from boundless.kv.transfer import DEVICE, HOST, BlockRef, BlockTransfer
from boundless.transport.base import TransportError


def _recv(recv_id: int, count_first: bool = False) -> RemoteRecv:
    return RemoteRecv(recv_id, "peer", recv_id, (1, 2, 3), 3, count_first)


def _send(send_id: int) -> RemoteSend:
    return RemoteSend(send_id, "peer", send_id, (BlockRef(HOST, 4),), 1)


def test_a_receive_is_done_once_every_rank_has_its_share_valid_as_far_as_all() -> None:
    streams = SplitStreams(ranks=2)
    streams.expect([_recv(1), _recv(2)], [])
    # Rank 0 has both; no other rank has either: nothing is reported yet.
    assert streams.agree(RemoteReport(recvs=(RemoteRecvDone(2, 3), RemoteRecvDone(1, 3)))).recvs == ()
    assert streams.waiting
    streams.rank_done(1, RemoteReport(recvs=(RemoteRecvDone(1, 2),)))
    streams.rank_done(2, RemoteReport(recvs=(RemoteRecvDone(1, 3), RemoteRecvDone(2, 3))))
    # Stream 1 is on every rank (rank 1 found 2 valid blocks of 3); stream 2 waits for rank 1.
    assert streams.agree(RemoteReport()).recvs == (RemoteRecvDone(1, 2),)
    assert streams.waiting
    streams.rank_done(1, RemoteReport(recvs=(RemoteRecvDone(2, 3),)))
    assert streams.agree(RemoteReport()).recvs == (RemoteRecvDone(2, 3),)
    assert not streams.waiting


def test_shares_merge_to_the_least_valid_and_any_failure_fails_the_stream() -> None:
    streams = SplitStreams(ranks=1)
    streams.expect([_recv(1), _recv(2)], [_send(3), _send(4)])
    streams.rank_done(1, RemoteReport(
        recvs=(RemoteRecvDone(1, 2), RemoteRecvDone(2, 0, "no complete stream")),
        sends=(RemoteSendDone(3, "peer gone"), RemoteSendDone(4)),
    ))  # fmt: skip
    agreed = streams.agree(RemoteReport(
        recvs=(RemoteRecvDone(1, 3), RemoteRecvDone(2, 3)), sends=(RemoteSendDone(4), RemoteSendDone(3))
    ))  # fmt: skip
    assert agreed.recvs == (RemoteRecvDone(1, 2), RemoteRecvDone(2, 0, "no complete stream"))
    assert agreed.sends == (RemoteSendDone(4), RemoteSendDone(3, "peer gone"))  # (rank 0's order)


def test_a_stream_the_other_ranks_never_heard_of_fails_and_the_totals_count_every_ranks_bytes() -> None:
    streams = SplitStreams(ranks=2)
    streams.rank_done(1, RemoteReport(recvs=(RemoteRecvDone(9, 3),), stats=RemoteIOStats(bytes_received=100)))
    streams.rank_done(2, RemoteReport(stats=RemoteIOStats(bytes_sent=7, bytes_received=50)))
    rank0 = RemoteIOStats(bytes_sent=5, bytes_received=100, blocks_received=3)
    ran_alone = RemoteReport(
        recvs=(RemoteRecvDone(9, 3),), sends=(RemoteSendDone(8),), stats=rank0, counts=(RemoteRecvCount(9, 3),)
    )
    agreed = streams.agree(ran_alone)
    # Rank 0's share alone: the other ranks' blocks never came (a receive counts none; nothing is counted).
    assert agreed.recvs == (RemoteRecvDone(9, 0, "the stream ran on rank 0 alone"),) and agreed.counts == ()
    assert agreed.sends == (RemoteSendDone(8, "the stream ran on rank 0 alone"),)
    assert agreed.stats == RemoteIOStats(bytes_sent=12, bytes_received=250, blocks_received=3)


def test_a_counted_first_receive_is_counted_once_every_rank_has_its_count() -> None:
    streams = SplitStreams(ranks=1)
    streams.expect([_recv(1, count_first=True), _recv(2, count_first=True)], [])
    # Rank 0's counts come first: neither is counted until rank 1's has come (its gates are set by then).
    assert streams.agree(RemoteReport(counts=(RemoteRecvCount(1, 3), RemoteRecvCount(2, 3)))).counts == ()
    streams.rank_done(1, RemoteReport(counts=(RemoteRecvCount(1, 2),)))
    assert streams.agree(RemoteReport()).counts == (RemoteRecvCount(1, 2),)  # (as far as the least)
    # Stream 2 fails on rank 1 before its count came: it ends uncounted, and its count is never reported.
    streams.rank_done(1, RemoteReport(recvs=(RemoteRecvDone(2, 0, "no complete stream"),)))
    agreed = streams.agree(RemoteReport(recvs=(RemoteRecvDone(2, 3),)))
    assert agreed.counts == () and agreed.recvs == (RemoteRecvDone(2, 0, "no complete stream"),)
    assert not streams.waiting
    assert streams.agree(RemoteReport()).counts == ()
    # The ranks retire the gates of the receives reported, once, when told.
    assert streams.take_reported() == [2] and streams.take_reported() == []


class _Handle:
    """A receive the test completes by hand (or fails)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.landed, self.error = tensor, False, None

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.landed

    def wait(self, timeout_s: float | None = None) -> None:
        if self.error is not None:
            raise self.error


class _Transport:
    """Receives posted and left for the test to land: the streams' messages without a peer."""

    address = "test"

    def __init__(self) -> None:
        self.handles: list[_Handle] = []

    def recv(self, peer: str, tag: int, tensor: torch.Tensor) -> _Handle:
        self.handles.append(_Handle(tensor))
        return self.handles[-1]

    def close(self) -> None:
        pass


class _Tier:
    def __init__(self) -> None:
        self.data = torch.zeros(2, 2, 1, 8, 4, 4)  # [layers, k/v, heads, blocks, block size, head dim]

    def write_blocks(self, ids, values) -> None:  # type: ignore[no-untyped-def]
        self.data[:, :, :, list(ids)] = values


def _wait_for(condition) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_split_engines_failed_gate_stays_until_every_ranks_share_is_reported() -> None:
    """Both ranks' counts came (the manager named the blocks) and rank 0's receive then failed, rank 1's still landing:
    rank 0 keeps its failed gate until told the receive is reported (a step copying the blocks meanwhile waits at the
    gate and fails there, where an ungated copy took half-landed KV on rank 0 alone), then drops it."""
    recv = RemoteRecv(1, "peer0\npeer1", 7, (3, 4), 2, count_first=True)
    tiers = {DEVICE: _Tier(), HOST: _Tier()}
    transport = _Transport()
    rank0 = RemoteIO(tiers, transport, timeout_s=30, retire_on_report=False)  # type: ignore[arg-type]
    streams = SplitStreams(ranks=1)
    streams.expect([recv], [])
    try:
        rank0.start([recv], [])
        _wait_for(lambda: len(transport.handles) == 4)  # (the count, two layers, the trailer)
        count, layer0 = transport.handles[0], transport.handles[1]
        count.tensor[0], count.landed, layer0.landed = 2, True, True
        _wait_for(lambda: rank0.recv_gates([3, 4]))
        streams.rank_done(1, RemoteReport(counts=(RemoteRecvCount(1, 2),)))
        transport.handles[2].error = TransportError("the peer went away")
        _wait_for(lambda: rank0.stats.recv_failures == 1)
        agreed = streams.agree(rank0.report())
        assert agreed.counts == (RemoteRecvCount(1, 2),) and agreed.recvs == ()  # (named; the failure held for rank 1)
        copies = [
            BlockTransfer(BlockRef(HOST, 3), BlockRef(DEVICE, 0)),
            BlockTransfer(BlockRef(HOST, 4), BlockRef(DEVICE, 1)),
        ]
        now, landing = split_landing(copies, rank0, tiers)  # type: ignore[arg-type]
        assert now == [] and landing is not None  # gated: the copy fails at the gate
        with pytest.raises(LayerLost):
            landing.finish()
        rank0.retire([1])
        assert rank0.recv_gates([3, 4]) == {}
    finally:
        rank0.close()
