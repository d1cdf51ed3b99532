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

No stream fails in simulation (no instance dies), so the handoff timeouts never fire on a stream; they do on
a prepared call whose first token takes longer than the engine allows, as in the real engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from boundless.cluster.links import Link, Traffic
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

    def start(self, recvs: list[RemoteRecv], sends: list[RemoteSend], now: float, step_end: float) -> None:
        """Post a step's receives and start its sends (a layerwise one ends no earlier than ``step_end``)."""
        for recv in recvs:
            self._recvs[recv.recv_id] = recv
            self.fabric.posted(self, recv)
        for send in sends:
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
            self.fabric.sent(send.peer, send.tag, _Stream(arrives, len(send.src), send.num_blocks))

    def received(self, recv: RemoteRecv, stream: _Stream) -> None:
        valid = max(0, min(len(recv.dst_ids), stream.num_valid))
        self._recvs.pop(recv.recv_id, None)
        self.stats.streams_received += 1
        self.stats.bytes_received += stream.num_blocks * self.bytes_per_block
        self.stats.blocks_received += valid
        self._done_recvs.append((stream.arrives_at, RemoteRecvDone(recv.recv_id, valid)))
        self.fabric.wake(self.instance_id, stream.arrives_at)

    def next_done(self) -> float | None:
        """When the next of its streams ends; None when none has a known end (a receive still unsent)."""
        return min([t for t, _ in self._done_recvs] + [t for t, _ in self._done_sends], default=None)

    def report(self, now: float) -> RemoteReport:
        """The streams ended by ``now``, with the running counters."""
        recvs = tuple(done for t, done in self._done_recvs if t <= now)
        sends = tuple(done for t, done in self._done_sends if t <= now)
        self._done_recvs = [(t, d) for t, d in self._done_recvs if t > now]
        self._done_sends = [(t, d) for t, d in self._done_sends if t > now]
        return RemoteReport(recvs, sends, RemoteIOStats(**vars(self.stats)))


class KVFabric:
    """The compute network between simulated instances: it pairs a stream's send with its receive by (the
    receiver's address, tag), whichever comes first, and tells ``wake`` when an instance's stream will end (an
    idle instance waiting for one sleeps until then)."""

    def __init__(self, wake: Wake | None = None) -> None:
        self._wake = wake
        self._ends: dict[str, SimulatedRemoteIO] = {}  # address -> that instance's end
        self._waiting: dict[tuple[str, int], RemoteRecv] = {}  # posted receives, by (address, tag)
        self._early: dict[tuple[str, int], _Stream] = {}  # streams sent before their receive was posted

    def attach(
        self, instance_id: str, address: str, link: Link, latency_s: float, bytes_per_block: int
    ) -> SimulatedRemoteIO:
        end = SimulatedRemoteIO(instance_id, address, link, latency_s, bytes_per_block, self)
        self._ends[address] = end
        return end

    def posted(self, end: SimulatedRemoteIO, recv: RemoteRecv) -> None:
        key = (end.address, recv.tag)
        stream = self._early.pop(key, None)
        if stream is None:
            self._waiting[key] = recv
        else:
            end.received(recv, stream)

    def sent(self, peer: str, tag: int, stream: _Stream) -> None:
        key = (peer, tag)
        recv = self._waiting.pop(key, None)
        if recv is None:
            self._early[key] = stream
        else:
            self._ends[peer].received(recv, stream)

    def wake(self, instance_id: str, at: float) -> None:
        if self._wake is not None:
            self._wake(instance_id, at)
