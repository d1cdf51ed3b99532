"""Moves of KV blocks between instances: plain data between the KV manager and the executor.

A prefill engine hands a request's KV to a decode engine, and under DualPath's DE-read path a decode
engine hands a stored prefix to a prefill engine. Both are the same move: *a block stream*, a fixed number
of full blocks sent from one instance's memory tiers into host blocks the other reserved for them. Blocks
are content-addressed, so the stream carries no names: both sides know the request's token ids and which
block indices the stream covers, and the receiver names the blocks it receives with its own chained hashes
(``kv/block_hash.py``), exactly as a prefix-cache hit would name them.

On the wire (any :class:`~boundless.transport.base.KVTransport`, one tag per stream) a stream of ``n``
blocks is ``L + 1`` messages in order: layer ``i``'s slice of the ``n`` blocks, ``[2, kv_heads, n,
block_size, head_dim]``, for ``i`` in ``0..L-1``, then a trailer, one int64: how many leading blocks are
valid. Both sides agree on ``n`` beforehand, so the receiver posts every receive at once into tensors of
the right size, and a receive that times out stays in line and swallows its late message (the transport's
rule): nothing is ever held for a stream nobody waits for. A sender that lacks some of the blocks it
promised (a store read failed its checksum) sends zeros in their place and says so in the trailer; the
receiver names only the valid ones, and the rest are recomputed.

A stream may also be *counted first* (a DE-read push with ``--layerwise-load on``): the count of valid blocks
goes ahead of the layers as one more int64 (the sender knows it when the stream starts), so the receiver can name
the blocks and let its request run while the layers are still coming, copying each into place as it lands
(``kv/remote_io.py``, ``kv/layer_gate.py``).

A *layerwise* send goes out during the step that computes the blocks: the executor hooks the forward pass
and sends layer ``i`` as soon as layer ``i`` has stored its KV, so the receiver has the early layers while
the sender computes the late ones. Other sends go out from memory as soon as the step applies them.

The executor runs the streams in the background (``kv/remote_io.py``) and reports them done or failed in
a later step's result, as the disk store's reads are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from boundless.kv.transfer import BlockRef


@dataclass(frozen=True)
class RemoteRecv:
    """Receive a stream of ``num_blocks`` blocks from ``peer`` on ``tag`` into host blocks ``dst_ids``; blocks
    beyond ``dst_ids`` (host memory had no room) are received and dropped, so the peer's messages are taken."""

    recv_id: int
    peer: str
    tag: int
    dst_ids: tuple[int, ...]
    num_blocks: int
    count_first: bool = False  # the valid count comes ahead of the layers; each layer is usable as it lands


@dataclass(frozen=True)
class RemoteSend:
    """Send a stream of ``num_blocks`` blocks to ``peer`` on ``tag``: ``src`` are the leading valid ones
    (in memory tiers; the rest go as zeros). ``layerwise``: during this step's forward pass, layer by layer."""

    send_id: int
    peer: str
    tag: int
    src: tuple[BlockRef, ...]
    num_blocks: int
    layerwise: bool = False
    count_first: bool = False  # send the valid count ahead of the layers (the receiver's ``count_first``)

    def __post_init__(self) -> None:
        if len(self.src) > self.num_blocks:
            raise ValueError("a stream cannot carry more valid blocks than it has")


@dataclass(frozen=True)
class RemoteRecvDone:
    """A finished receive: its first ``num_valid`` host blocks hold the stream's valid blocks (0 on failure)."""

    recv_id: int
    num_valid: int
    error: str | None = None


@dataclass(frozen=True)
class RemoteRecvCount:
    """A counted-first receive's count has come: its first ``num_valid`` host blocks will hold valid blocks, each
    layer usable once it has landed (its gate, ``RemoteIO.recv_gates_for``); the receive is reported done later."""

    recv_id: int
    num_valid: int


@dataclass(frozen=True)
class RemoteSendDone:
    """A finished send (``error`` when it failed or timed out; the peer then recomputes)."""

    send_id: int
    error: str | None = None


@dataclass
class RemoteIOStats:
    """The executor's block streams so far (cumulative)."""

    streams_sent: int = 0
    streams_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0  # valid blocks
    blocks_received: int = 0  # valid blocks named on arrival
    send_failures: int = 0
    recv_failures: int = 0  # timeouts included
    recv_timeouts: int = 0
    # Sends due during a step (a handoff): seconds from a stream's first layer to its trailer, and of those, the
    # seconds after the step's forward pass ended (what the overlap did not hide). 1 - exposed / stream is the
    # overlap (0 when sent after the forward pass).
    layerwise_streams: int = 0
    layerwise_stream_s: float = 0.0
    layerwise_exposed_s: float = 0.0
    # Counted-first receives (a DE-read push under --layerwise-load on): their counts come, and of the forward
    # passes' waits at a layer of one, how many found the layer not yet landed and how long they waited.
    counted_recvs: int = 0
    recv_layer_waits: int = 0
    recv_layer_wait_s: float = 0.0


@dataclass(frozen=True)
class RemoteReport:
    """What the executor's streams finished since its last report, with its running totals."""

    recvs: tuple[RemoteRecvDone, ...] = ()
    sends: tuple[RemoteSendDone, ...] = ()
    stats: RemoteIOStats | None = None
    counts: tuple[RemoteRecvCount, ...] = ()  # counted-first receives whose count came (before their ``recvs``)
