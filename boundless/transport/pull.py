"""Two-sided messages over a one-sided library (NIXL, Mooncake): the receiver pulls.

This is the flow of vLLM's NIXL connector for a prefill-to-decode handoff, and it is the same for every
library that reads registered memory and carries small notifications:

1. the sender makes its tensors readable (registers them, unless :meth:`register` covered them already)
   and notifies the receiver ``S <tag> <id> <address>:<length>,...``;
2. once a receive for (peer, tag) is posted, the receiver reads those bytes straight into its tensors
   (cut into pieces where either side's tensors end) and then notifies the sender ``D <id>``;
3. the sender's send is done at ``D`` (its tensors may be reused). A receive that was given up still
   answers ``D`` without reading, so no sender is left waiting.

A library plugs in with the few methods at the end of :class:`PullTransport`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from boundless.transport.base import (
    CompletedHandle,
    PolledHandle,
    Segment,
    Tensors,
    TransferHandle,
    TransportError,
    as_byte_views,
    pair_segments,
    segments,
)
from boundless.transport.matching import Matcher, Posting


def encode_offer(tag: int, msg_id: int, segs: list[Segment]) -> str:
    return f"S {tag} {msg_id} " + ",".join(f"{a}:{n}" for a, n in segs)


def encode_done(msg_id: int) -> str:
    return f"D {msg_id}"


@dataclass(eq=False)
class Offer:
    """A message announced by a peer and not read yet: where its bytes are on the sender."""

    peer: str
    msg_id: int
    remote: list[Segment]


@dataclass(eq=False)
class _SendOp:
    views: list[torch.Tensor]  # held until done: the reader reads them in place
    done: bool = False
    temp: object = None  # what to release when done


@dataclass(eq=False)
class _RecvOp:
    views: list[torch.Tensor]
    done: bool = False
    error: TransportError | None = None
    temp: object = None
    read: object = None  # the library's token for the read in flight


@dataclass(eq=False)
class _Reads:
    pending: list[tuple[Posting[_RecvOp], Offer]] = field(default_factory=list)  # not startable yet
    running: list[tuple[Posting[_RecvOp], Offer]] = field(default_factory=list)


class PullTransport:
    """Messages as notified offers and reads (see the module docstring); subclasses bind a library."""

    kind = "pull"
    timeout_s: float = 30.0

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._next_id = 0
        self._sends: dict[int, _SendOp] = {}
        self._reads = _Reads()
        self._matcher: Matcher[_RecvOp, Offer] = Matcher()

    def send(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle:
        views = as_byte_views(tensors)
        with self._lock:
            msg_id = self._next_id
            self._next_id += 1
            try:
                key = self._connect(peer)
                op = _SendOp(views, temp=self._make_readable(key, views))
                self._sends[msg_id] = op
                self._notify(key, encode_offer(tag, msg_id, segments(views)))
            except TransportError as e:
                self._sends.pop(msg_id, None)
                return CompletedHandle(e)
        return PolledHandle(lambda: self._send_done(op), self.timeout_s, f"{self.kind} send to {peer} tag {tag}")

    def recv(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle:
        op = _RecvOp(as_byte_views(tensors))
        with self._lock:
            try:
                key = self._connect(peer)
            except TransportError as e:
                return CompletedHandle(e)
            posting, offer = self._matcher.post((key, tag), op)
            if offer is not None:
                self._start(posting, offer)
        return PolledHandle(
            lambda: self._recv_done(op),
            self.timeout_s,
            f"{self.kind} recv from {peer} tag {tag}",
            cancel=lambda: self._cancel(posting),
        )

    def _cancel(self, posting: Posting[_RecvOp]) -> None:
        """Give up a receive. A read not started never will be, and its sender is released; one running
        writes into the tensors until it ends, so it is waited for (the library bounds it)."""
        with self._lock:
            self._matcher.cancel(posting)
            for item in [i for i in self._reads.pending if i[0] is posting]:
                self._reads.pending.remove(item)
                self._ack(item[1].peer, item[1].msg_id)

        def read_over() -> bool:
            with self._lock:
                self._pump()
                return not any(i[0] is posting for i in self._reads.running)

        PolledHandle(read_over, self.timeout_s, "the read of a receive given up").wait()

    # -- progress -----------------------------------------------------------------------------------

    def _send_done(self, op: _SendOp) -> bool:
        with self._lock:
            self._pump()
        return op.done

    def _recv_done(self, op: _RecvOp) -> bool:
        with self._lock:
            self._pump()
        if op.error is not None:
            raise op.error
        return op.done

    def _pump(self) -> None:
        for peer, msg in self._notifications():
            kind, _, body = msg.partition(" ")
            if kind == "S":
                tag, msg_id, segs = body.split(" ", 2)
                remote = [(int(a), int(n)) for a, n in (s.split(":") for s in segs.split(",") if s)]
                self._offer(peer, int(tag), Offer(peer, int(msg_id), remote))
            elif kind == "D":
                sent = self._sends.pop(int(body), None)
                if sent is not None:
                    self._release(sent.temp)
                    sent.done = True
        pending, self._reads.pending = self._reads.pending, []
        for posting, offer in pending:
            self._start(posting, offer)
        for item in list(self._reads.running):
            posting, offer = item
            op = posting.target
            state = self._read_state(op.read)
            if state is None:
                continue
            self._reads.running.remove(item)
            self._release(op.temp)
            if state:
                op.error = state
            else:
                op.done = True
                self._ack(offer.peer, offer.msg_id)

    def _offer(self, peer: str, tag: int, offer: Offer) -> None:
        posting = self._matcher.next_posting((peer, tag))
        if posting is None:
            self._matcher.hold((peer, tag), offer)
        elif posting.cancelled:
            self._ack(peer, offer.msg_id)  # release the sender unread
        else:
            self._start(posting, offer)

    def _start(self, posting: Posting[_RecvOp], offer: Offer) -> None:
        op = posting.target
        try:
            pieces = pair_segments(segments(op.views), offer.remote)
        except TransportError as e:
            op.error = e
            self._ack(offer.peer, offer.msg_id)
            return
        if not pieces:
            op.done = True
            self._ack(offer.peer, offer.msg_id)
            return
        if op.temp is None:
            op.temp = self._make_writable(op.views)
        try:
            read = self._start_read(offer.peer, pieces)
        except TransportError as e:
            self._release(op.temp)
            op.error = e
            return
        if read is None:
            self._reads.pending.append((posting, offer))  # the library is not ready for it yet
            return
        op.read = read
        self._reads.running.append((posting, offer))

    def _ack(self, peer: str, msg_id: int) -> None:
        with contextlib.suppress(TransportError):  # a sender gone needs no ack
            self._notify(peer, encode_done(msg_id))

    # -- what a library provides ----------------------------------------------------------------------

    def _connect(self, peer: str) -> str:
        """The key this library knows the peer by (connecting the first time); PeerGone if it cannot."""
        raise NotImplementedError

    def _make_readable(self, peer: str, views: list[torch.Tensor]) -> object:
        """Let ``peer`` read ``views``; returns what :meth:`_release` undoes."""
        raise NotImplementedError

    def _make_writable(self, views: list[torch.Tensor]) -> object:
        raise NotImplementedError

    def _release(self, temp: object) -> None:
        raise NotImplementedError

    def _notify(self, peer: str, msg: str) -> None:
        raise NotImplementedError

    def _notifications(self) -> list[tuple[str, str]]:
        """(peer key, message) received since the last call."""
        raise NotImplementedError

    def _start_read(self, peer: str, pieces: list[tuple[int, int, int]]) -> object | None:
        """Start reading (local address, remote address, length) pieces; None when it cannot start yet."""
        raise NotImplementedError

    def _read_state(self, read: object) -> TransportError | Literal[False] | None:
        """None while running, False when done, the error when it failed."""
        raise NotImplementedError
