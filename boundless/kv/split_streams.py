"""Block streams between instances of a model split over tensor-parallel ranks, as rank 0 reports them to the manager.

A prefill engine and a decode engine split alike (``--tensor-parallel-size``) move a request's KV rank to rank: rank
``r`` of one sends its share of every block (its key/value heads) to rank ``r`` of the other, over an endpoint of its
own (``transport/endpoints.py``: an instance's address names its ranks' endpoints), into host blocks with the same
ids as rank 0's (the KV manager is rank 0's; every rank's pools have as many blocks). No KV crosses the ranks' pipes.

A stream is therefore done only once every rank's share of it is: a receive, once every rank's host blocks hold their
share (before that some rank may still be copying into the blocks the manager reserved), valid as far as every rank's
is, failed if any rank's failed (its blocks are then recomputed on every rank, as a stream that fails on one device);
a send, once every rank has sent its share (the manager holds the blocks until then), failed if any rank's did.

A counted-first receive (a decode engine's push under ``--layerwise-load on``: its count of valid blocks comes ahead of
its layers, and the prefill engine's forward pass copies each layer as it lands) is counted once every rank's count has
come (each rank has then set the gates its own forward pass waits on), as far as the least; each rank's gates stay
until rank 0 has reported the receive (:meth:`SplitStreams.take_reported`: a rank retiring a failed gate on its own,
before the manager heard of the failure, would let a step copy the block unguarded there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TypeVar

from boundless.kv.remote_moves import (
    RemoteIOStats,
    RemoteRecv,
    RemoteRecvCount,
    RemoteRecvDone,
    RemoteReport,
    RemoteSend,
    RemoteSendDone,
)

_Done = TypeVar("_Done")  # a RemoteRecvDone, a RemoteSendDone or a RemoteRecvCount


class SplitStreams:
    """Rank 0's account of the streams it has sent the other ranks (``ranks`` of them, numbered from 1): which each
    rank has finished, and how. Pure bookkeeping; the pipes are the caller's."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._recvs: dict[int, dict[int, RemoteRecvDone]] = {}  # recv id -> rank -> that rank's finished share
        self._sends: dict[int, dict[int, RemoteSendDone]] = {}
        self._held_recvs: list[RemoteRecvDone] = []  # rank 0's finished shares, in the order they finished
        self._held_sends: list[RemoteSendDone] = []
        self._counts: dict[int, dict[int, RemoteRecvCount]] = {}  # counted-first receives: rank -> its count
        self._held_counts: list[RemoteRecvCount] = []
        self._stats: dict[int, RemoteIOStats] = {}  # each other rank's latest running totals
        self._reported: list[int] = []  # receives reported since :meth:`take_reported`

    def expect(self, recvs: Iterable[RemoteRecv], sends: Iterable[RemoteSend]) -> None:
        """Note the step's streams, which every rank runs its share of."""
        for recv in recvs:
            self._recvs[recv.recv_id] = {}
            if recv.count_first:
                self._counts[recv.recv_id] = {}
        for send in sends:
            self._sends[send.send_id] = {}

    def rank_done(self, rank: int, report: RemoteReport) -> None:
        """Rank ``rank`` (1 or more) finished its shares of these streams (one not expected is ignored: its step
        failed)."""
        for recv in report.recvs:
            if (found := self._recvs.get(recv.recv_id)) is not None:
                found[rank] = recv
        for send in report.sends:
            if (sent := self._sends.get(send.send_id)) is not None:
                sent[rank] = send
        for count in report.counts:
            if (counted := self._counts.get(count.recv_id)) is not None:
                counted[rank] = count
        if report.stats is not None:
            self._stats[rank] = report.stats

    def agree(self, rank0: RemoteReport) -> RemoteReport:
        """With rank 0's report since the last call, the streams now finished on every rank, in the order rank 0
        finished them, and the running totals: rank 0's, with the bytes every rank moved."""
        self._held_recvs.extend(rank0.recvs)
        self._held_sends.extend(rank0.sends)
        self._held_counts.extend(rank0.counts)
        counts, self._held_counts = _agreed(
            self._held_counts, self._counts, self.ranks, lambda c: c.recv_id, _merge_count
        )
        recvs, self._held_recvs = _agreed(self._held_recvs, self._recvs, self.ranks, lambda r: r.recv_id, _merge_recv)
        sends, self._held_sends = _agreed(self._held_sends, self._sends, self.ranks, lambda s: s.send_id, _merge_send)
        stats = rank0.stats
        if stats is not None and self._stats:
            others = self._stats.values()
            stats = dataclasses.replace(
                stats,
                bytes_sent=stats.bytes_sent + sum(s.bytes_sent for s in others),
                bytes_received=stats.bytes_received + sum(s.bytes_received for s in others),
            )
        # A receive that ended without every rank's count (failed on a rank before its count came) is not counted now.
        ended = {r.recv_id for r in recvs}
        self._held_counts = [c for c in self._held_counts if c.recv_id not in ended]
        for recv_id in ended:
            self._counts.pop(recv_id, None)
        self._reported += ended
        return RemoteReport(tuple(recvs), tuple(sends), stats, tuple(counts))

    def take_reported(self) -> list[int]:
        """The receives reported (by :meth:`agree`) since the last call: the ranks may retire their gates now."""
        reported, self._reported = self._reported, []
        return reported

    @property
    def waiting(self) -> bool:
        """Whether a stream rank 0 has finished (or counted) waits for another rank's share."""
        return bool(self._held_recvs or self._held_sends or self._held_counts)


# (Should rank 0 finish a stream the other ranks never heard of, its share alone: the others' blocks never came.)
_ALONE = "the stream ran on rank 0 alone"


def _merge_recv(shares: list[RemoteRecvDone]) -> RemoteRecvDone:
    error = next((s.error for s in shares if s.error is not None), None if len(shares) > 1 else _ALONE)
    return RemoteRecvDone(shares[0].recv_id, 0 if error else min(s.num_valid for s in shares), error)


def _merge_count(shares: list[RemoteRecvCount]) -> RemoteRecvCount | None:
    return RemoteRecvCount(shares[0].recv_id, min(s.num_valid for s in shares)) if len(shares) > 1 else None


def _merge_send(shares: list[RemoteSendDone]) -> RemoteSendDone:
    alone = None if len(shares) > 1 else _ALONE
    return RemoteSendDone(shares[0].send_id, next((s.error for s in shares if s.error is not None), alone))


def _agreed(
    held: list[_Done],
    others: dict[int, dict[int, _Done]],
    ranks: int,
    key: Callable[[_Done], int],
    merge: Callable[[list[_Done]], _Done | None],
) -> tuple[list[_Done], list[_Done]]:
    """Of rank 0's finished shares ``held``, those every other rank has finished too, merged (``merge`` of rank 0's
    alone: one the other ranks never heard of), and those still held."""
    agreed, still = [], []
    for done in held:
        stream_id = key(done)
        shares = others.get(stream_id)
        if shares is not None and len(shares) < ranks:
            still.append(done)
            continue
        if shares is not None:
            del others[stream_id]
        merged = merge([done, *(shares or {}).values()])
        if merged is not None:
            agreed.append(merged)
    return agreed, still
