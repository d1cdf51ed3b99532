"""torch.distributed point-to-point: gloo on the CPU, NCCL on a GPU, by the same code.

The endpoints of one world form a process group of their own (not torch's default group, so an instance
may hold others, and tests may hold several): each joins with its rank through a ``torch.distributed``
store (a ``FileStore`` on one node, a ``TCPStore`` across nodes). An endpoint's address is its rank.

Sends and receives are the group's ``send``/``recv`` with the tag; a message of several tensors is one
operation per tensor, in order. A receive lands first in a buffer of its own and is copied into the
caller's tensors when complete: torch cannot withdraw a posted receive, so one that timed out would
otherwise write into tensors the caller has freed when its message comes late. The copy costs one memory
copy of the message; the late message lands in the abandoned buffer.

A waiter thread per operation in flight blocks in ``Work.wait()`` and the caller's deadline is the
handle's own (see :class:`_WorkHandle`); the waiter waits a day, so that gloo never closes a connection
for a late message. The group's timeout (``timeout_s``) bounds joining it. gloo reports a peer whose
process died as a closed connection ("Connection closed by peer"), raised here as :class:`PeerGone`.
NCCL ignores tags and matches operations in the order they are issued, and an operation that never
completes there leaves the communicator to be aborted; it is not exercised on this machine (no GPU).
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.distributed as dist

from boundless.transport.base import (
    CompletedHandle,
    PeerGone,
    Tensors,
    TransferHandle,
    TransferTimeout,
    TransportError,
    as_byte_views,
    total_bytes,
)

_NEVER = datetime.timedelta(days=1)  # gloo closes the connection when a wait times out
_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")


def _error(e: BaseException, what: str) -> TransportError:
    text = str(e)
    if any(m in text for m in _GONE_MARKERS):
        return PeerGone(f"{what}: {text.splitlines()[0]}")
    if "Timed out" in text or "timed out" in text or "timeout" in text.lower():
        return TransferTimeout(f"{what}: {text.splitlines()[0]}")
    return TransportError(f"{what}: {text.splitlines()[0]}")


class _PointToPoint(Protocol):
    """What this transport uses of a torch.distributed backend (``ProcessGroupGloo``, ``ProcessGroupNCCL``): its
    point-to-point calls, which both have and PyTorch's stubs leave out of their base class."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


@dataclass
class _Op:
    works: list
    what: str
    stage: torch.Tensor | None = None  # a receive's own buffer
    views: list[torch.Tensor] | None = None  # where a receive's bytes go when complete
    lock: threading.Lock = field(default_factory=threading.Lock)

    def complete(self) -> None:
        """Wait for the group's operations (as good as no timeout: see the module docstring),
        then copy a receive's bytes out of its buffer unless it was abandoned meanwhile."""
        try:
            for w in self.works:
                w.wait(_NEVER)
        except RuntimeError as e:
            raise _error(e, self.what) from e
        with self.lock:
            if self.stage is not None and self.views is not None:
                at = 0
                for v in self.views:
                    v.copy_(self.stage[at : at + v.numel()])
                    at += v.numel()

    def abandon(self) -> None:
        with self.lock:  # waits for a copy under way: after this, nothing writes the caller's tensors
            self.views = None


class _WorkHandle:
    """An operation completed by a waiter thread, which blocks in ``Work.wait()``.

    gloo offers no poll: its point-to-point ``Work.is_completed`` turns true only inside ``wait``, and
    ``wait(timeout)`` closes the connection to the peer when it times out ("Application timeout caused pair
    closure"), which would turn one late message into a lost peer. So a thread waits without a timeout and
    the caller's deadline is the handle's own."""

    def __init__(self, op: _Op, waiters: ThreadPoolExecutor, default_timeout_s: float) -> None:
        self._op = op
        self._timeout_s = default_timeout_s
        self._future: Future[None] = waiters.submit(op.complete)
        self._timed_out: TransferTimeout | None = None

    def done(self) -> bool:
        if self._timed_out is not None:
            raise self._timed_out
        if not self._future.done():
            return False
        self._future.result()  # raises the operation's failure
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        if self._timed_out is not None:
            raise self._timed_out
        timeout = self._timeout_s if timeout_s is None else timeout_s
        try:
            self._future.result(timeout)
        except FutureTimeout:
            self._op.abandon()
            if self._future.done() and self._future.exception() is None:
                return  # it completed as we gave up, before abandon: the bytes are there
            self._timed_out = TransferTimeout(f"{self._op.what}: no completion in {timeout:g} s")
            raise self._timed_out from None


class TorchDistTransport:
    """Rank ``rank`` of a ``world_size``-endpoint group over ``store`` (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        device: str | torch.device = "cpu",
        timeout_s: float = 30.0,
    ) -> None:
        self.kind = f"torch-{backend}"
        self.address = str(rank)
        self.rank = rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        # The group's timeout bounds joining it; operations wait with their own (see _Op.complete).
        timeout = datetime.timedelta(seconds=timeout_s)
        self._waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="transport-wait")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown torch.distributed backend {backend!r} (gloo or nccl)")
        self._group: _PointToPoint | None  # (None once closed)
        try:
            if backend == "gloo":
                self._group = cast(_PointToPoint, dist.ProcessGroupGloo(store, rank, world_size, timeout))
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._group = cast(_PointToPoint, dist.ProcessGroupNCCL(store, rank, world_size, options))
        except RuntimeError as e:  # a rank that does not join in time
            raise TransferTimeout(f"joining a {backend} group of {world_size} as rank {rank}: {e}") from e

    def register(self, tensor: torch.Tensor) -> None:
        """Nothing to register: the group sends from and receives into any tensor on its device."""

    def unregister(self, tensor: torch.Tensor) -> None:
        """Nothing was registered."""

    def send(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle:
        views = as_byte_views(tensors)
        what = f"send to rank {peer} tag {tag}"
        group = self._group
        assert group is not None, "the transport is closed"
        try:
            works = [group.send([v], int(peer), tag) for v in views]
        except RuntimeError as e:
            return CompletedHandle(_error(e, what))
        return _WorkHandle(_Op(works, what), self._waiters, self.timeout_s)

    def recv(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle:
        views = as_byte_views(tensors)
        what = f"recv from rank {peer} tag {tag}"
        stage = torch.empty(total_bytes(views), dtype=torch.uint8, device=views[0].device if views else self.device)
        parts, at = [], 0
        for v in views:
            parts.append(stage[at : at + v.numel()])
            at += v.numel()
        group = self._group
        assert group is not None, "the transport is closed"
        try:
            works = [group.recv([p], int(peer), tag) for p in parts]
        except RuntimeError as e:
            return CompletedHandle(_error(e, what))
        return _WorkHandle(_Op(works, what, stage, views), self._waiters, self.timeout_s)

    def close(self) -> None:
        # The group's connections close with it; waiters still blocked on abandoned receives end then.
        self._group = None
        self._waiters.shutdown(wait=False, cancel_futures=True)
