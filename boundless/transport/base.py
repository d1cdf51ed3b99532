"""The one interface for moving tensors between instances: KV blocks, query vectors, partials.

A :class:`KVTransport` is one endpoint. Peers name each other by the string in ``transport.address``
(handed around by the control plane: Ray today, a rendezvous directory in tests and benchmarks). A message
is one or more contiguous tensors sent with an integer tag; the receiver posts a receive for (peer, tag)
into tensors it has already allocated (the KV blocks it reserved, a buffer for the partials), so the bytes
land where they are used. Messages between two endpoints with the same tag arrive in the order they were
sent; different tags do not wait for each other. The transport moves bytes: dtypes (bf16, fp32, ...) and
sizes are the caller's, and the receiving tensors must hold exactly as many bytes as were sent.

Every operation is asynchronous and returns a :class:`TransferHandle`; ``wait`` takes a timeout and
raises :class:`TransferTimeout`, :class:`PeerGone` or :class:`TransportError` rather than hang. A send is
done when its tensors may be reused (their bytes are on their way or delivered); a receive is done when
its tensors hold the message. After a receive's wait times out its tensors are never written (a read
already under way is waited for first): the message, if it comes late, is swallowed by the abandoned
receive, so the caller may free them at once. A send that timed out may still be read by its peer until
the peer takes it or is gone (the pulling libraries read the sender's memory in place): send tensors
that stay unchanged, such as the gathered copy ``send_blocks`` makes.

Peers run side by side. torch.distributed, shared memory and NIXL move bytes on threads of their own while
the caller computes; the pulling transports (NIXL, Mooncake) start a read and acknowledge a message when
one of their handles is polled or waited on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

Tensors = torch.Tensor | Sequence[torch.Tensor]


class TransportError(RuntimeError):
    """A transfer failed (a message of the wrong size, the library reported an error)."""


class PeerGone(TransportError):
    """The peer's process is gone or its connection closed: nothing more will come from or reach it."""


class TransferTimeout(TransportError):
    """A transfer did not complete in the time given; it is abandoned (see the module docstring)."""


class TransferHandle(Protocol):
    """An operation in flight."""

    def done(self) -> bool:
        """Make progress; True once complete. Raises the operation's failure."""
        ...

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until complete, at most ``timeout_s`` (the transport's default when None)."""
        ...


@runtime_checkable
class KVTransport(Protocol):
    """One endpoint of a transport between instances (see the module docstring)."""

    kind: str
    address: str

    def register(self, tensor: torch.Tensor) -> None:
        """Tell the transport that ``tensor`` (a KV cache, a staging buffer) will be sent from or received
        into often, so that libraries that pin or register memory do it once. Optional to call."""
        ...

    def unregister(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register` (before the tensor is freed)."""
        ...

    def send(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle: ...

    def recv(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle: ...

    def close(self) -> None: ...


def as_byte_views(tensors: Tensors) -> list[torch.Tensor]:
    """Each tensor as a flat uint8 view of its bytes (no copy); contiguous tensors only, since a view of
    anything else would be a copy that the receive could not write back through."""
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    out = []
    for t in items:
        if not t.is_contiguous():
            raise ValueError("the transport moves contiguous tensors; gather the blocks into one first")
        out.append(t.reshape(-1).view(torch.uint8))
    return out


def total_bytes(views: Sequence[torch.Tensor]) -> int:
    return sum(v.numel() for v in views)


class CompletedHandle:
    """An operation that completed (or failed) when it was issued."""

    def __init__(self, error: TransportError | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        self.done()


class PolledHandle:
    """A handle completed by polling: ``poll`` makes progress and says whether the operation is complete
    (raising its failure); ``cancel`` is called once when a wait times out, so the operation never writes
    into the caller's tensors afterwards. Between polls a wait calls ``block(seconds)``, which may return
    early when something arrives (a transport with sockets selects on them); the default sleeps."""

    # Spin briefly (a small message arrives within microseconds), then back off, to 200 us at most: a
    # library with nothing to select on is polled that often.
    SPIN_S = 50e-6
    MAX_SLEEP_S = 200e-6

    def __init__(
        self,
        poll: Callable[[], bool],
        default_timeout_s: float,
        what: str,
        cancel: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        block: Callable[[float], None] = time.sleep,
    ) -> None:
        self._poll = poll
        self._default_timeout_s = default_timeout_s
        self._what = what
        self._cancel = cancel
        self._clock = clock
        self._block = block
        self._complete = False
        self._error: TransportError | None = None

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        if not self._complete:
            try:
                self._complete = self._poll()
            except TransportError as e:
                self._error = e
                raise
        return self._complete

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = self._default_timeout_s if timeout_s is None else timeout_s
        start = self._clock()
        pause = 0.0
        while not self.done():
            waited = self._clock() - start
            if waited >= timeout:
                self._error = TransferTimeout(f"{self._what}: no completion in {timeout:g} s")
                if self._cancel is not None:
                    self._cancel()
                raise self._error
            if waited > self.SPIN_S:
                pause = min(self.MAX_SLEEP_S, max(1e-5, pause * 2))
                self._block(min(pause, timeout - waited))


Segment = tuple[int, int]  # (address, length in bytes)


def segments(views: Sequence[torch.Tensor]) -> list[Segment]:
    return [(v.data_ptr(), v.numel()) for v in views if v.numel()]


def pair_segments(local: Sequence[Segment], remote: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """(local address, remote address, length) pieces that cover both sides' segments in order, cut where
    either side's segments end: the two sides may split one message into tensors differently."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise TransportError(f"message of {sum(n for _, n in remote)} bytes into tensors of {sum(n for _, n in local)}")
    out: list[tuple[int, int, int]] = []
    i = j = 0
    li = ri = 0  # bytes of local[i], remote[j] already covered
    while i < len(local) and j < len(remote):
        n = min(local[i][1] - li, remote[j][1] - ri)
        out.append((local[i][0] + li, remote[j][0] + ri, n))
        li += n
        ri += n
        if li == local[i][1]:
            i, li = i + 1, 0
        if ri == remote[j][1]:
            j, ri = j + 1, 0
    return out
