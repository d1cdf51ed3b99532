"""Shared memory between processes of one node: control over a Unix socket, bytes through /dev/shm.

Each endpoint listens on ``<address>.sock`` (a ``SOCK_SEQPACKET`` Unix socket: reliable, ordered, message
boundaries kept). A sender connects to its peer's socket once and owns a slot file ``<address>.to.<peer>``
in the same directory, mapped by both sides and grown (never shrunk) to fit the largest message, so its
pages stay resident and a message costs two memory copies (into the slot, out of it) and two small socket
messages (``S`` then the receiver's ``A``, after which the slot takes the next message). Messages up to
``inline_max`` bytes (query vectors, partials) travel inside the socket message instead, with no ack.

A progress thread per endpoint (blocked in ``select`` on the sockets) moves messages while the caller
computes; waits poll too. The socket is also how death is seen: a peer that exits closes its connections
(EOF on ours), and a peer that is gone refuses a new one, so a receive from a dead peer fails with
:class:`PeerGone` at once rather than at its timeout. A peer once gone is connected to again when next used: an
instance restarted in its place (``cluster/restarts.py``) listens at the same address. The syscalls on the socket
order the slot's writes before its reads.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from boundless.transport.base import (
    CompletedHandle,
    PeerGone,
    PolledHandle,
    Tensors,
    TransferHandle,
    TransportError,
    as_byte_views,
    total_bytes,
)
from boundless.transport.matching import Matcher, Posting

_HEADER = struct.Struct("<cqQ")  # kind, tag, nbytes
_HELLO, _INLINE, _SLOT, _ACK = b"H", b"I", b"S", b"A"
_MIN_SLOT = 1 << 20


def _scatter(payload: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy a message's bytes into the receiving tensors, in order."""
    if payload.numel() != total_bytes(views):
        raise TransportError(f"message of {payload.numel()} bytes into tensors of {total_bytes(views)}")
    at = 0
    for v in views:
        v.copy_(payload[at : at + v.numel()])
        at += v.numel()


class _Mapping:
    """A file in /dev/shm mapped as a uint8 tensor."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, size)
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, self.size)
        # Never an inference tensor, whatever mode maps it (a forward pass's partials, say): messages outside
        # inference mode (moves of KV blocks) are copied into it later, which an inference tensor refuses.
        with torch.inference_mode(False):
            self.view = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.view
        with contextlib.suppress(BufferError):  # a tensor still views it: the GC closes it later
            self.map.close()
        os.close(self.fd)


@dataclass(eq=False)
class _SendOp:
    tag: int
    views: list[torch.Tensor]
    done: bool = False
    error: TransportError | None = None


@dataclass
class _RecvOp:
    views: list[torch.Tensor]
    done: bool = False
    error: TransportError | None = None


@dataclass
class _Outgoing:
    """Our connection to a peer's socket and the slot we send through."""

    sock: socket.socket
    slot_path: str
    slot: _Mapping | None = None
    busy: bool = False  # a slot message not yet acked
    queue: deque[_SendOp] = field(default_factory=deque)
    error: PeerGone | None = None


@dataclass
class _Incoming:
    """A peer's connection to our socket; ``peer`` is known once its hello came."""

    sock: socket.socket
    peer: str | None = None
    slot_path: str | None = None
    slot: _Mapping | None = None


class ShmTransport:
    """Endpoint ``name`` in ``directory`` (on /dev/shm for memory speed); see the module docstring."""

    kind = "shm"

    def __init__(self, directory: str | Path, name: str, timeout_s: float = 30.0, inline_max: int = 32 << 10) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.address = str(self.dir / name)
        self.timeout_s = timeout_s
        self.inline_max = inline_max
        self._lock = threading.RLock()
        # Receives completed or failed so far, and their signal: a receiver with many streams in flight sleeps
        # until the next one (:meth:`wait_delivery`) rather than polling them.
        self._deliveries = 0
        self._delivered = threading.Condition(self._lock)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address + ".sock")
        self._listener.bind(self.address + ".sock")
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._rxbuf = bytearray(_HEADER.size + max(inline_max, 1024))
        self._out: dict[str, _Outgoing] = {}
        self._in: list[_Incoming] = []
        self._gone: dict[str, PeerGone] = {}
        self._matcher: Matcher[_RecvOp, torch.Tensor] = Matcher()
        self._closed = False
        self._progress = threading.Thread(target=self._progress_loop, name=f"shm-{name}", daemon=True)
        self._progress.start()

    # -- the interface ------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> None:
        """Nothing to register: the bytes are copied through the slot."""

    def unregister(self, tensor: torch.Tensor) -> None:
        """Nothing was registered."""

    def send(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle:
        op = _SendOp(tag, as_byte_views(tensors))
        with self._lock:
            try:
                out = self._outgoing(peer)
            except PeerGone as e:
                return CompletedHandle(e)
            out.queue.append(op)
            self._progress_out(peer, out)
        return PolledHandle(
            lambda: self._send_done(peer, op),
            self.timeout_s,
            f"send to {peer} tag {tag}",
            cancel=lambda: self._cancel_send(peer, op),
            block=self._block,
        )

    def recv(self, peer: str, tag: int, tensors: Tensors) -> TransferHandle:
        op = _RecvOp(as_byte_views(tensors))
        with self._lock:
            posting, held = self._matcher.post((peer, tag), op)
            if held is not None:
                try:
                    _scatter(held, op.views)
                except TransportError as e:
                    return CompletedHandle(e)
                return CompletedHandle()
        return PolledHandle(
            lambda: self._recv_done(peer, posting),
            self.timeout_s,
            f"recv from {peer} tag {tag}",
            cancel=lambda: self._cancel_recv(posting),
            block=self._block,
        )

    @property
    def deliveries(self) -> int:
        """How many receives have completed or failed so far (for :meth:`wait_delivery`)."""
        return self._deliveries

    def wait_delivery(self, seen: int, timeout_s: float) -> None:
        """Wait until a receive has completed or failed after the first ``seen`` (:attr:`deliveries`, read before
        the caller last looked at its receives, so none is missed), ``timeout_s`` at most."""
        with self._delivered:
            self._delivered.wait_for(lambda: self._deliveries != seen or self._closed, timeout=timeout_s)

    def _delivery(self) -> None:
        """A receive completed or failed (under the lock)."""
        self._deliveries += 1
        self._delivered.notify_all()

    def _cancel_send(self, peer: str, op: _SendOp) -> None:
        """A send given up before it left: it never will (its tensors may be reused at once)."""
        with self._lock:
            out = self._out.get(peer)
            if out is not None and op in out.queue:
                out.queue.remove(op)

    def _cancel_recv(self, posting: Posting[_RecvOp]) -> None:
        with self._lock:  # deliveries run under the lock: none writes the tensors after this
            self._matcher.cancel(posting)
            # The posting waits in line for its message, which it swallows; one that never comes (a KV lending move
            # its debtor gave up) kept the tensors for as long as the endpoint lived.
            posting.target.views = []

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._delivered.notify_all()
            for out in self._out.values():
                out.sock.close()
                if out.slot is not None:
                    out.slot.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(out.slot_path)
            for inc in self._in:
                inc.sock.close()
                if inc.slot is not None:
                    inc.slot.close()
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address + ".sock")
        if threading.current_thread() is not self._progress:
            self._progress.join(timeout=1)

    def _progress_loop(self) -> None:
        """Sends queued behind the slot go out when their ack comes, and messages are taken as they come,
        while the caller computes (a sender of KV layer by layer does not wait on each layer)."""
        while not self._closed:
            self._block(0.05)
            with self._lock:
                if self._closed:
                    return
                for peer, out in list(self._out.items()):
                    self._progress_out(peer, out)
                self._progress_in()

    def _block(self, seconds: float) -> None:
        """Wait until one of our sockets has something to read (a message, an ack, a connection, a close),
        at most ``seconds`` (a wait's back-off, so a long one is never missed for good)."""
        with self._lock:
            socks = [self._listener, *(i.sock for i in self._in), *(o.sock for o in self._out.values())]
        with contextlib.suppress(OSError, ValueError):  # a socket closed meanwhile: poll again
            select.select(socks, [], [], max(seconds, 1e-3))

    # -- sending ------------------------------------------------------------------------------------

    def _outgoing(self, peer: str) -> _Outgoing:
        out = self._out.get(peer)
        if out is None:
            # A peer gone is tried again: a restarted instance listens at its predecessor's address (a dead one's
            # socket refuses at once).
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(peer + ".sock")
            except (FileNotFoundError, ConnectionRefusedError) as e:
                sock.close()
                raise self._mark_gone(peer, f"cannot connect: {e}") from e
            self._gone.pop(peer, None)
            slot_path = f"{self.address}.to.{Path(peer).name}"
            hello = json.dumps({"peer": self.address, "slot": slot_path}).encode()
            sock.sendall(_HEADER.pack(_HELLO, 0, len(hello)) + hello)
            sock.setblocking(False)
            out = self._out[peer] = _Outgoing(sock, slot_path)
        return out

    def _send_done(self, peer: str, op: _SendOp) -> bool:
        with self._lock:
            out = self._out.get(peer)
            if out is not None and not op.done:
                self._progress_out(peer, out)
            self._progress_in()  # the peer may be waiting on us to take its messages before it acks ours
        if op.error is not None:
            raise op.error
        return op.done

    def _progress_out(self, peer: str, out: _Outgoing) -> None:
        """Take acks, then push queued messages while the slot is free."""
        try:
            while True:
                try:
                    data = out.sock.recv(64)
                except BlockingIOError:
                    break
                if not data:
                    raise ConnectionResetError("connection closed")
                out.busy = False  # the only thing a receiver says on our connection is "ack"
            while out.queue and not out.busy:
                op = out.queue[0]
                nbytes = total_bytes(op.views)
                if nbytes <= self.inline_max:
                    msg = bytearray(_HEADER.size + nbytes)
                    _HEADER.pack_into(msg, 0, _INLINE, op.tag, nbytes)
                    self._gather(op.views, torch.frombuffer(msg, dtype=torch.uint8)[_HEADER.size :])
                    if not self._try_send(out.sock, msg):
                        break
                else:
                    slot = self._slot_for(out, nbytes)
                    self._gather(op.views, slot.view[:nbytes])
                    if not self._try_send(out.sock, _HEADER.pack(_SLOT, op.tag, nbytes)):
                        break
                    out.busy = True
                out.queue.popleft()
                op.done = True
        except OSError as e:
            gone = self._mark_gone(peer, str(e))
            for op in out.queue:
                op.error = gone
            out.queue.clear()

    @staticmethod
    def _gather(views: list[torch.Tensor], dst: torch.Tensor) -> None:
        at = 0
        for v in views:
            dst[at : at + v.numel()].copy_(v)
            at += v.numel()

    @staticmethod
    def _try_send(sock: socket.socket, msg: bytes | bytearray) -> bool:
        try:
            sock.send(msg, socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return False
        return True

    @staticmethod
    def _slot_for(out: _Outgoing, nbytes: int) -> _Mapping:
        if out.slot is None or out.slot.size < nbytes:
            size = max(_MIN_SLOT, 1 << (nbytes - 1).bit_length())
            if out.slot is not None:
                out.slot.close()
            out.slot = _Mapping(out.slot_path, size, create=True)
        return out.slot

    # -- receiving ----------------------------------------------------------------------------------

    def _recv_done(self, peer: str, posting: Posting[_RecvOp]) -> bool:
        op = posting.target
        with self._lock:
            if not op.done and op.error is None:
                self._progress_in()
            if not op.done and op.error is None:
                self._check_alive(peer, posting)
        if op.error is not None:
            raise op.error
        return op.done

    def _check_alive(self, peer: str, posting: Posting[_RecvOp]) -> None:
        """A receive from a peer that is gone fails now (it may have died before ever connecting to us)."""
        try:
            out = self._outgoing(peer)
            self._progress_out(peer, out)
            if out.error is None and peer not in self._gone:
                return
        except PeerGone:
            pass
        self._progress_in()  # what it sent before it went is still ours
        if not posting.target.done:
            self._fail_postings(peer)

    def _progress_in(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                break
            sock.setblocking(False)
            self._in.append(_Incoming(sock))
        for inc in list(self._in):
            self._drain(inc)

    def _drain(self, inc: _Incoming) -> None:
        while True:
            try:
                n = inc.sock.recv_into(self._rxbuf)
            except BlockingIOError:
                return
            except OSError:
                n = 0
            if n == 0:
                self._in.remove(inc)
                inc.sock.close()
                if inc.peer is not None:
                    self._mark_gone(inc.peer, "connection closed")
                    self._fail_postings(inc.peer)
                return
            kind, tag, nbytes = _HEADER.unpack_from(self._rxbuf)
            if kind == _HELLO:
                hello = json.loads(bytes(self._rxbuf[_HEADER.size : _HEADER.size + nbytes]))
                inc.peer, inc.slot_path = hello["peer"], hello["slot"]
                self._gone.pop(inc.peer, None)  # a peer that came back (same address, new process)
            elif kind == _INLINE:
                payload = torch.frombuffer(self._rxbuf, dtype=torch.uint8)[_HEADER.size : _HEADER.size + nbytes]
                self._deliver(inc, tag, payload)
            elif kind == _SLOT:
                assert inc.slot_path is not None
                if inc.slot is None or inc.slot.size < nbytes:
                    if inc.slot is not None:
                        inc.slot.close()
                    inc.slot = _Mapping(inc.slot_path, 0, create=False)
                self._deliver(inc, tag, inc.slot.view[:nbytes])
                with contextlib.suppress(OSError):  # a sender gone is seen at its EOF
                    inc.sock.send(_HEADER.pack(_ACK, tag, 0), socket.MSG_NOSIGNAL)

    def _deliver(self, inc: _Incoming, tag: int, payload: torch.Tensor) -> None:
        assert inc.peer is not None
        key = (inc.peer, tag)
        posting = self._matcher.next_posting(key)
        if posting is None:
            self._matcher.hold(key, payload.clone())
        elif not posting.cancelled:
            try:
                _scatter(payload, posting.target.views)
                posting.target.done = True
            except TransportError as e:
                posting.target.error = e
            self._delivery()

    # -- peers gone ---------------------------------------------------------------------------------

    def _mark_gone(self, peer: str, why: str) -> PeerGone:
        gone = self._gone.setdefault(peer, PeerGone(f"shm peer {peer}: {why}"))
        out = self._out.pop(peer, None)
        if out is not None:
            out.error = gone
            out.sock.close()
            if out.slot is not None:
                out.slot.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out.slot_path)
        return gone

    def _fail_postings(self, peer: str) -> None:
        gone = self._gone.get(peer) or self._mark_gone(peer, "gone")
        for posting in self._matcher.postings_from(peer):
            posting.target.error = gone
        self._delivery()
