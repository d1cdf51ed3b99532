"""KV streams between simulated instances (prefill/decode handoff, DualPath's DE-read push) in virtual time.

The engines decide the streams exactly as the real ones do: a step's ``remote_recvs`` and ``remote_sends``
(``kv/remote_moves.py``) are plain data in its :class:`~boundless.engine.scheduler.SchedulerOutput`, and their
ends come back in a later step's :class:`~boundless.kv.remote_moves.RemoteReport`. Only the executor's side
(``kv/remote_io.py``: a transport and threads) is replaced: :class:`KVFabric` matches each send with the
receive posted for it by (receiver's address, tag), as the transports do, and a send's bytes (every block of
the stream, valid or zeros, as on the wire) cross the sender's ``network`` link, a
:class:`~boundless.cluster.links.Link` in its virtual-time API, queued behind that instance's other sends. A
layerwise send (a handoff: the prefill engine streams each layer as its forward pass stores it) cannot end
before the step that computes it does; a send from memory starts at once. A receive ends when its stream's
last byte has arrived, plus the link's latency.

A stream fails only with an instance (``sim/failures.py``): when one stops (:meth:`KVFabric.lose`), every stream
to or from it that has not ended by then never completes, and its live end fails it as the real ``RemoteIO`` does
when its transport's wait times out: a receive ``timeout_s`` after it was posted (or at once, if that is past), a
send ``timeout_s`` after the loss (its first wait that blocks). Streams started afterwards with the lost instance
fail the same way, ``timeout_s`` after they start. A stream that ended before the loss stands. The handoff timeouts
also fire on a prepared call whose first token takes longer than the engine allows, as in the real engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from boundless.cluster.links import Link, Traffic
from boundless.kv.remote_io import DEFAULT_TIMEOUT_S
from boundless.kv.remote_moves import (
    RemoteIOStats,
    RemoteRecv,
    RemoteRecvDone,
    RemoteReport,
    RemoteSend,
    RemoteSendDone,
)

Wake = Callable[[str, float], None]  # tell the simulator: instance ``id`` has a stream ending at ``t``


@dataclass
class _Stream:
    """One stream between its two ends: when its last byte arrives and how many of its blocks are valid."""

    arrives_at: float
    num_valid: int
    num_blocks: int
    sender: str = ""  # its sender's address


@dataclass
class SimulatedRemoteIO:
    """One instance's end of the fabric: its streams in flight and its counters, as ``RemoteIO`` keeps them."""

    instance_id: str
    address: str
    link: Link
    latency_s: float
    bytes_per_block: int
    fabric: KVFabric
    stats: RemoteIOStats = field(default_factory=RemoteIOStats)
    _recvs: dict[int, RemoteRecv] = field(default_factory=dict)  # posted, their stream not yet sent
    _done_recvs: list[tuple[float, RemoteRecvDone]] = field(default_factory=list)
    _done_sends: list[tuple[float, RemoteSendDone]] = field(default_factory=list)
    # Streams not reported yet: a receive's peer and when it was posted, a send's peer (what a peer's loss fails).
    _open_recvs: dict[int, tuple[str, float]] = field(default_factory=dict)
    _open_sends: dict[int, str] = field(default_factory=dict)

    def start(self, recvs: list[RemoteRecv], sends: list[RemoteSend], now: float, step_end: float) -> None:
        """Post a step's receives and start its sends (a layerwise one ends no earlier than ``step_end``)."""
        for recv in recvs:
            self._recvs[recv.recv_id] = recv
            self._open_recvs[recv.recv_id] = (recv.peer, now)
            self.fabric.posted(self, recv, now)
        for send in sends:
            if self.fabric.is_lost(send.peer):  # nobody takes its first message: the wait times out
                self._send_failed(send.send_id, send.peer, now + self.fabric.timeout_s)
                continue
            self._open_sends[send.send_id] = send.peer
            nbytes = send.num_blocks * self.bytes_per_block
            transfer = self.link.submit(nbytes, now, Traffic.KV)
            arrives = self.link.estimated_finish(transfer) + self.latency_s
            if send.layerwise:
                arrives = max(arrives, step_end + self.latency_s)  # its last layer is stored at the step's end
            self.stats.streams_sent += 1
            self.stats.bytes_sent += nbytes
            self.stats.blocks_sent += len(send.src)
            self._done_sends.append((arrives, RemoteSendDone(send.send_id)))
            self.fabric.wake(self.instance_id, arrives)
            self.fabric.sent(send.peer, send.tag, _Stream(arrives, len(send.src), send.num_blocks, self.address))

    def received(self, recv: RemoteRecv, stream: _Stream) -> None:
        valid = max(0, min(len(recv.dst_ids), stream.num_valid))
        self._recvs.pop(recv.recv_id, None)
        self.stats.streams_received += 1
        self.stats.bytes_received += stream.num_blocks * self.bytes_per_block
        self.stats.blocks_received += valid
        self._done_recvs.append((stream.arrives_at, RemoteRecvDone(recv.recv_id, valid)))
        self.fabric.wake(self.instance_id, stream.arrives_at)

    def recv_failed(self, recv: RemoteRecv, at: float) -> None:
        """A receive whose stream will never complete: it fails at ``at`` (its deadline)."""
        self._recvs.pop(recv.recv_id, None)
        self.stats.recv_failures += 1
        self.stats.recv_timeouts += 1
        error = f"no complete stream from {recv.peer} in {self.fabric.timeout_s:g} s"
        self._done_recvs.append((at, RemoteRecvDone(recv.recv_id, 0, error)))
        self.fabric.wake(self.instance_id, at)

    def _send_failed(self, send_id: int, peer: str, at: float) -> None:
        self.stats.send_failures += 1
        error = f"TransportError: {peer} took no message in {self.fabric.timeout_s:g} s"
        self._done_sends.append((at, RemoteSendDone(send_id, error)))
        self.fabric.wake(self.instance_id, at)

    def peer_lost(self, address: str, now: float) -> None:
        """The instance at ``address`` stopped at ``now``: this end's streams with it that have not ended fail, each
        at its deadline (see the module docstring)."""
        timeout = self.fabric.timeout_s
        for recv in [r for r in self._recvs.values() if r.peer == address]:  # posted, nothing sent yet
            self.recv_failed(recv, max(self._open_recvs[recv.recv_id][1] + timeout, now))
        recvs = []
        for t, done in self._done_recvs:
            peer, posted = self._open_recvs.get(done.recv_id, ("", 0.0))
            if t <= now or peer != address or done.error is not None:
                recvs.append((t, done))
                continue
            self.stats.streams_received -= 1  # counted when it was matched: its bytes never all arrive
            self.stats.blocks_received -= done.num_valid
            self.stats.recv_failures += 1
            self.stats.recv_timeouts += 1
            at = max(posted + timeout, now)
            recvs.append((at, RemoteRecvDone(done.recv_id, 0, f"no complete stream from {address} in {timeout:g} s")))
            self.fabric.wake(self.instance_id, at)
        self._done_recvs = recvs
        failed = {
            d.send_id
            for t, d in self._done_sends
            if t > now and d.error is None and self._open_sends.get(d.send_id) == address
        }
        self._done_sends = [(t, d) for t, d in self._done_sends if d.send_id not in failed]
        for send_id in failed:
            self.stats.streams_sent -= 1  # counted when it started
            self._send_failed(send_id, address, now + timeout)

    def next_done(self) -> float | None:
        """When the next of its streams ends; None when none has a known end (a receive still unsent). A stream
        failing at its deadline does not count: an engine with nothing else to do sleeps until woken then (the
        fabric wakes it) or until a call comes, where a step lasting until the deadline would keep out the calls
        that come meanwhile (the real engine's loop takes them at once)."""
        recvs = [t for t, d in self._done_recvs if d.error is None]
        return min(recvs + [t for t, d in self._done_sends if d.error is None], default=None)

    def report(self, now: float) -> RemoteReport:
        """The streams ended by ``now``, with the running counters."""
        recvs = tuple(done for t, done in self._done_recvs if t <= now)
        sends = tuple(done for t, done in self._done_sends if t <= now)
        self._done_recvs = [(t, d) for t, d in self._done_recvs if t > now]
        self._done_sends = [(t, d) for t, d in self._done_sends if t > now]
        for recv in recvs:
            self._open_recvs.pop(recv.recv_id, None)
        for send in sends:
            self._open_sends.pop(send.send_id, None)
        return RemoteReport(recvs, sends, RemoteIOStats(**vars(self.stats)))


class KVFabric:
    """The compute network between simulated instances: it pairs a stream's send with its receive by (the
    receiver's address, tag), whichever comes first, and tells ``wake`` when an instance's stream will end (an
    idle instance waiting for one sleeps until then). ``timeout_s``: how long an end waits for a stream that does
    not come (``--kv-handoff-timeout-s``), which only a lost instance's streams reach."""

    def __init__(self, wake: Wake | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._wake = wake
        self.timeout_s = timeout_s
        self._ends: dict[str, SimulatedRemoteIO] = {}  # address -> that instance's end
        self._waiting: dict[tuple[str, int], RemoteRecv] = {}  # posted receives, by (address, tag)
        self._early: dict[tuple[str, int], _Stream] = {}  # streams sent before their receive was posted
        self._lost: set[str] = set()  # addresses of instances that stopped

    def attach(
        self, instance_id: str, address: str, link: Link, latency_s: float, bytes_per_block: int
    ) -> SimulatedRemoteIO:
        end = SimulatedRemoteIO(instance_id, address, link, latency_s, bytes_per_block, self)
        self._ends[address] = end
        return end

    def posted(self, end: SimulatedRemoteIO, recv: RemoteRecv, now: float) -> None:
        key = (end.address, recv.tag)
        stream = self._early.pop(key, None)
        if stream is not None:
            end.received(recv, stream)
        elif recv.peer in self._lost:  # its sender is gone: nothing will come
            end.recv_failed(recv, now + self.timeout_s)
        else:
            self._waiting[key] = recv

    def sent(self, peer: str, tag: int, stream: _Stream) -> None:
        key = (peer, tag)
        recv = self._waiting.pop(key, None)
        if recv is None:
            self._early[key] = stream
        else:
            self._ends[peer].received(recv, stream)

    def is_lost(self, address: str) -> bool:
        return address in self._lost

    def lose(self, address: str, now: float) -> None:
        """The instance at ``address`` stopped at ``now``: its streams not ended by then never complete (their live
        ends fail them at their deadlines), and it takes part in no other."""
        if address in self._lost:
            return
        self._lost.add(address)
        self._waiting = {key: recv for key, recv in self._waiting.items() if key[0] != address and recv.peer != address}
        self._early = {
            key: stream
            for key, stream in self._early.items()
            if key[0] != address and not (stream.sender == address and stream.arrives_at > now)
        }
        for other, end in self._ends.items():
            if other != address:
                end.peer_lost(address, now)

    def rejoin(self, address: str) -> None:
        """An instance restarted at ``address`` (its new end attached) takes part in streams again; those of its
        predecessor stay failed."""
        self._lost.discard(address)

    def wake(self, instance_id: str, at: float) -> None:
        if self._wake is not None:
            self._wake(instance_id, at)
