"""The executor's side of KV moves between instances: block streams over a transport, in the background.

Each step, :meth:`RemoteIO.start` takes the step's :class:`~boundless.kv.remote_moves.RemoteRecv` s and
:class:`~boundless.kv.remote_moves.RemoteSend` s (``kv/remote_moves.py`` describes a stream):

- a receive posts every message of its stream at once into a staging tensor (a layer's slice of the host
  tier's blocks is not contiguous, and transports move contiguous tensors); a receiver thread polls them and,
  when the trailer has come, copies the valid blocks into the host blocks the manager reserved for them
  (nothing else touches those until the receive is reported, as with a disk load). A *counted-first* receive (a
  DE-read push under ``--layerwise-load on``) reports its count as soon as it comes, with a fallible
  :class:`~boundless.kv.layer_gate.LayerGate` over its valid blocks (:meth:`RemoteIO.recv_gates`), and copies
  each layer into the host blocks as it lands, opening the gate layer by layer: the manager names the blocks
  at the count, the request runs, and a step that copies them to the device does so layer by layer as its
  forward pass reaches each (``engine/executor.py``). A receive that fails fails its gate. A receive not complete
  ``timeout_s`` after it was posted is cancelled (its late messages are swallowed by the transport) and
  reported failed, so its host blocks are freed;
- a send is queued for a sender thread, layer by layer: all at once for a send from memory, or, for a
  layerwise send, each layer as the step's forward pass has stored it (the hook :meth:`start` returns; the
  runner calls it after every layer). The sender gathers the layer's slice of the blocks (blocks the
  manager holds until the send is reported), waits for the emulated network link when there is one, sends,
  and waits for the transport (at most ``timeout_s``). A failed send skips the rest of its stream. A send
  from memory whose blocks a layerwise load is still carrying from the store (``kv/layer_gate.py``: a DE-read
  push) sends each layer as it arrives, so the storage link, the network link and the peer overlap.

Finished streams are collected by :meth:`RemoteIO.report` for a step's result.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from boundless.kv.cache_dtype import index_copy, index_select
from boundless.kv.layer_gate import LayerGate
from boundless.kv.remote_moves import (
    RemoteIOStats,
    RemoteRecv,
    RemoteRecvCount,
    RemoteRecvDone,
    RemoteReport,
    RemoteSend,
    RemoteSendDone,
)
from boundless.kv.transfer import DEVICE, HOST, BlockRef, TierId
from boundless.transport.base import KVTransport, TransferHandle, TransportError
from boundless.transport.endpoints import rank_address

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
_POLL_S = 0.001  # the receiver's poll while streams are in flight (the transport moves bytes on its own)
# With a transport that signals its deliveries (``wait_delivery``), the receiver sleeps until the next one, and looks
# this often at most without one (a message that came before its receive was posted, a deadline, a peer never seen).
_IDLE_LOOK_S = 0.01
_COUNT = -1  # a piece that is a counted-first stream's count


@dataclass
class _Incoming:
    recv: RemoteRecv
    staging: torch.Tensor  # [layers, 2, kv_heads, n, block_size, head_dim]
    trailer: torch.Tensor  # int64 [1]: valid blocks
    handles: list[TransferHandle]  # (the count's first, when counted first) the layers', the trailer's
    deadline: float
    count: torch.Tensor | None = None  # int64 [1]: the valid blocks, ahead of the layers (counted first)
    gate: LayerGate | None = None  # once the count has come: which layers have landed in the host blocks
    layers_landed: int = 0


@dataclass
class _Outgoing:
    send: RemoteSend
    groups: list[tuple[TierId, torch.Tensor, torch.Tensor]]  # (tier, block ids, positions in the stream)
    gates: list[LayerGate] = field(default_factory=list)  # layerwise loads of its blocks still arriving
    error: str | None = None
    started_at: float | None = None
    forward_end: float | None = None  # a layerwise stream: when its step's forward pass ended
    layers_sent: int = 0


@dataclass
class _Piece:
    """One message of a stream for the sender: a layer, (``layer`` None) the trailer, or (``_COUNT``) the count."""

    stream: _Outgoing
    layer: int | None
    ready: object | None = None  # a CUDA event the layer's KV is complete at


@dataclass
class _Done:
    recvs: list[RemoteRecvDone] = field(default_factory=list)
    sends: list[RemoteSendDone] = field(default_factory=list)
    counts: list[RemoteRecvCount] = field(default_factory=list)


class RemoteIO:
    """Block streams between this instance's memory ``tiers`` and its peers over ``transport``.

    ``tiers`` maps tier ids to memory laid out ``[layers, 2, kv_heads, blocks, block_size, head_dim]`` in a
    ``data`` attribute (``PagedKVCache``, ``HostKVTier``). ``throttle(nbytes)`` blocks until that many bytes
    have crossed this instance's emulated network link (``cluster/links.py``), when there is one. With
    ``layerwise`` False, the sends due during a step go out only once its forward pass is over (the baseline
    the overlap is measured against).
    """

    def __init__(
        self,
        tiers: Mapping[TierId, object],
        transport: KVTransport,
        throttle: Callable[[int], object] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        layerwise: bool = True,
        rank: int = 0,
        retire_on_report: bool = True,
    ) -> None:
        self.tiers = tiers
        self.rank = rank  # of a model split over ranks: streams go to and come from the peers' ranks of this number
        # Whether a counted-first receive's gates go once :meth:`report` has said it ended (else at :meth:`retire`).
        self.retire_on_report = retire_on_report
        self.transport = transport
        self.throttle = throttle
        self.timeout_s = timeout_s
        self.clock = clock
        self.layerwise = layerwise
        # The gates of layerwise loads still arriving in blocks a send reads (``kv/layer_gate.py``; set by the
        # executor): a send from memory then goes out layer by layer as its blocks' layers arrive.
        self.gates_for: Callable[[Sequence[BlockRef]], list[LayerGate]] | None = None
        device = self._data(DEVICE)
        self.num_layers = device.shape[0]
        self._block_shape = (device.shape[1], device.shape[2], device.shape[4], device.shape[5])
        self._dtype = device.dtype
        self._on_gpu = device.is_cuda
        self.stats = RemoteIOStats()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._done = _Done()
        self._incoming: list[_Incoming] = []
        # Host blocks of counted-first receives, by block id: each one's gate, until its receive has been reported
        # (a failed gate stays until then, so no step scheduled before the report copies the block ungated).
        self._recv_gates: dict[int, LayerGate] = {}
        # By receive, once it ended: its gate and the host blocks it guards (a block a later receive took since keeps
        # that one's gate).
        self._gates_to_retire: dict[int, tuple[LayerGate, tuple[int, ...]]] = {}
        self._new_incoming: queue.Queue[_Incoming | None] = queue.Queue()
        self._pieces: queue.Queue[_Piece | None] = queue.Queue()
        self._step_streams: list[_Outgoing] = []  # this step's layerwise streams
        self._closed = False
        self._threads = [
            threading.Thread(target=self._receive_loop, name="boundless-kv-recv", daemon=True),
            threading.Thread(target=self._send_loop, name="boundless-kv-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _data(self, tier: TierId) -> torch.Tensor:
        return self.tiers[tier].data  # type: ignore[attr-defined]

    # -- the step ------------------------------------------------------------------------------------

    def start(self, recvs: Sequence[RemoteRecv], sends: Sequence[RemoteSend]) -> Callable[[int], None] | None:
        """Post the step's receives and queue its sends from memory; returns the per-layer hook of its layerwise
        sends (None when it has none), which the forward pass calls after each layer stores its KV."""
        for recv in recvs:
            self._post(recv)
        layerwise = []
        for send in sends:
            stream = _Outgoing(send, self._groups(send))
            if send.count_first:  # the valid count goes ahead of the layers (known now)
                self._pieces.put(_Piece(stream, _COUNT))
            if not send.layerwise:
                stream.gates = self.gates_for(send.src) if self.gates_for is not None else []
                for layer in range(self.num_layers):
                    self._pieces.put(_Piece(stream, layer))
                self._pieces.put(_Piece(stream, None))
            else:
                layerwise.append(stream)
        self._step_streams = layerwise
        if not layerwise or not self.layerwise:
            return None

        def after_layer(layer: int) -> None:
            ready = None
            if self._on_gpu:
                ready = torch.cuda.Event()
                ready.record()  # type: ignore[no-untyped-call]
            for stream in layerwise:
                self._pieces.put(_Piece(stream, layer, ready))

        return after_layer

    def end_step(self, ok: bool) -> None:
        """The step's forward pass is over (``ok``) or failed: its layerwise streams get their trailers, or
        fail (a failed step never stored its later layers)."""
        now = self.clock()
        for stream in self._step_streams:
            stream.forward_end = now
            if not ok:
                stream.error = stream.error or "the step computing the blocks failed"
            elif not self.layerwise:  # the baseline: every layer once the pass is over
                for layer in range(self.num_layers):
                    self._pieces.put(_Piece(stream, layer))
            self._pieces.put(_Piece(stream, None))
        self._step_streams = []

    def report(self, wait_s: float = 0.0) -> RemoteReport:
        """What finished since the last report (and the counts that came); with ``wait_s``, wait that long at most
        when nothing has."""
        with self._changed:
            if wait_s > 0 and not (self._done.recvs or self._done.sends or self._done.counts):
                self._changed.wait(timeout=wait_s)
            done, self._done = self._done, _Done()
            stats = RemoteIOStats(**vars(self.stats))
            if self.retire_on_report:  # their receives are reported: the manager names or forgets them now
                self._retire(list(self._gates_to_retire))
        return RemoteReport(tuple(done.recvs), tuple(done.sends), stats, tuple(done.counts))

    def retire(self, recv_ids: Sequence[int]) -> None:
        """Drop the gates of these ended receives, which the manager has heard of (a rank of a split model, whose
        reports go through rank 0: ``kv/split_streams.py``; without ``retire_on_report``)."""
        with self._lock:
            self._retire(recv_ids)

    def _retire(self, recv_ids: Sequence[int]) -> None:
        for recv_id in recv_ids:
            gate, block_ids = self._gates_to_retire.pop(recv_id, (None, ()))
            for block_id in block_ids:
                if self._recv_gates.get(block_id) is gate:
                    del self._recv_gates[block_id]

    def recv_gates(self, host_block_ids: Sequence[int]) -> dict[int, LayerGate]:
        """The gates of the counted-first receives still landing in any of these host blocks, by block id (a step
        copies those layer by layer, each once it has landed)."""
        with self._lock:
            if not self._recv_gates:
                return {}
            return {b: g for b in host_block_ids if (g := self._recv_gates.get(b)) is not None and not g.is_open}

    def count_layer_waits(self, waits: int, seconds: float) -> None:
        """What a step's forward pass spent waiting for layers of counted-first receives (for the stats)."""
        with self._lock:
            self.stats.recv_layer_waits += waits
            self.stats.recv_layer_wait_s += seconds

    def close(self) -> None:
        """Stop the threads (streams in flight are abandoned; the transport is its owner's to close)."""
        self._closed = True
        self._new_incoming.put(None)
        self._pieces.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    # -- receiving -----------------------------------------------------------------------------------

    def _post(self, recv: RemoteRecv) -> None:
        n = recv.num_blocks
        two, heads, bs, hd = self._block_shape
        staging = torch.empty((self.num_layers, two, heads, n, bs, hd), dtype=self._dtype)
        trailer = torch.zeros(1, dtype=torch.int64)
        count = torch.zeros(1, dtype=torch.int64) if recv.count_first else None
        peer = rank_address(recv.peer, self.rank)
        handles = [self.transport.recv(peer, recv.tag, count)] if count is not None else []
        handles += [self.transport.recv(peer, recv.tag, staging[i]) for i in range(self.num_layers)]
        handles.append(self.transport.recv(peer, recv.tag, trailer))
        self._new_incoming.put(_Incoming(recv, staging, trailer, handles, self.clock() + self.timeout_s, count))

    def _receive_loop(self) -> None:
        wait_delivery = getattr(self.transport, "wait_delivery", None)
        while not self._closed:
            if not self._incoming:
                item = self._new_incoming.get()
                if item is None:
                    return
                self._incoming.append(item)
            while True:
                try:
                    item = self._new_incoming.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                self._incoming.append(item)
            seen = self.transport.deliveries if wait_delivery is not None else 0
            for inc in list(self._incoming):
                if self._poll(inc):
                    self._incoming.remove(inc)
            if self._incoming:
                if wait_delivery is not None:
                    wait_delivery(seen, _IDLE_LOOK_S)
                else:
                    time.sleep(_POLL_S)

    def _poll(self, inc: _Incoming) -> bool:
        """Make progress on a receive; True once it is finished (complete, failed or timed out)."""
        error, timed_out = None, False
        try:
            if inc.count is not None:
                self._land_layers(inc)
            if all(h.done() for h in inc.handles):
                self._complete(inc)
                return True
            if self.clock() < inc.deadline:
                return False
            error, timed_out = (
                f"no complete stream from {rank_address(inc.recv.peer, self.rank)} in {self.timeout_s:g} s",
                True,
            )
        except TransportError as e:
            error = f"{type(e).__name__}: {e}"
        except Exception as e:  # anything else must not kill the receiver
            log.exception("receiving a KV stream failed")
            error = f"{type(e).__name__}: {e}"
        for handle in inc.handles:  # cancel what is left, so late messages go nowhere
            with contextlib.suppress(TransportError, OSError):  # (a transport closed under it raises OSError)
                handle.wait(0.0)
        log.warning("KV stream %d from %s failed: %s", inc.recv.recv_id, rank_address(inc.recv.peer, self.rank), error)
        with self._changed:
            if inc.gate is not None:  # a forward pass waiting for its next layer raises: the bytes are not here
                inc.gate.fail()
                self._gates_to_retire[inc.recv.recv_id] = (inc.gate, inc.recv.dst_ids)
            self.stats.recv_failures += 1
            self.stats.recv_timeouts += timed_out
            self._done.recvs.append(RemoteRecvDone(inc.recv.recv_id, 0, error))
            self._changed.notify_all()
        return True

    def _valid(self, inc: _Incoming, sent: torch.Tensor) -> int:
        return max(0, min(len(inc.recv.dst_ids), int(sent[0])))

    def _land_layers(self, inc: _Incoming) -> None:
        """A counted-first receive: once its count has come, report it with a gate over its valid blocks; then copy
        each layer that has landed (in order) into those host blocks and open the gate through it."""
        assert inc.count is not None
        if inc.gate is None:
            if not inc.handles[0].done():
                return
            valid = self._valid(inc, inc.count)
            inc.gate = LayerGate(self.num_layers, fallible=True)
            with self._changed:  # the gate first: no step may copy a named block before its layers land
                for block_id in inc.recv.dst_ids[:valid]:
                    self._recv_gates[block_id] = inc.gate
                self.stats.counted_recvs += 1
                self._done.counts.append(RemoteRecvCount(inc.recv.recv_id, valid))
                self._changed.notify_all()
        valid = self._valid(inc, inc.count)
        host = self._data(HOST)
        ids = torch.tensor(inc.recv.dst_ids[:valid], dtype=torch.long)
        while inc.layers_landed < self.num_layers and inc.handles[1 + inc.layers_landed].done():
            layer = inc.layers_landed
            if valid:
                index_copy(host[layer], 2, ids, inc.staging[layer][:, :, :valid])
            inc.layers_landed += 1
            inc.gate.open_through(layer)

    def _complete(self, inc: _Incoming) -> None:
        if inc.count is not None:  # counted first: its layers were landed as they came
            # The transport may have finished the last messages after this poll's landing looked at them and before
            # the stream was seen whole: land those now, or a step would read host blocks their bytes never reached.
            self._land_layers(inc)
            valid = self._valid(inc, inc.count)
            with self._changed:
                assert inc.gate is not None  # (its count came: landing set it)
                self._gates_to_retire[inc.recv.recv_id] = (inc.gate, inc.recv.dst_ids)
        else:
            valid = self._valid(inc, inc.trailer)
            if valid:
                self.tiers[HOST].write_blocks(inc.recv.dst_ids[:valid], inc.staging[:, :, :, :valid])  # type: ignore[attr-defined]
        with self._changed:
            self.stats.streams_received += 1
            self.stats.bytes_received += inc.staging.numel() * inc.staging.element_size()
            self.stats.blocks_received += valid
            self._done.recvs.append(RemoteRecvDone(inc.recv.recv_id, valid))
            self._changed.notify_all()

    # -- sending -------------------------------------------------------------------------------------

    def _groups(self, send: RemoteSend) -> list[tuple[TierId, torch.Tensor, torch.Tensor]]:
        by_tier: dict[TierId, tuple[list[int], list[int]]] = {}
        for position, ref in enumerate(send.src):
            ids, positions = by_tier.setdefault(ref.tier, ([], []))
            ids.append(ref.block_id)
            positions.append(position)
        return [
            (tier, torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long))
            for tier, (ids, pos) in by_tier.items()
        ]

    def _gather(self, stream: _Outgoing, layer: int) -> torch.Tensor:
        """Layer ``layer`` of the stream's blocks, ``[2, kv_heads, n, block_size, head_dim]`` in host memory."""
        n = stream.send.num_blocks
        groups = stream.groups
        if len(groups) == 1 and len(stream.send.src) == n:
            tier, ids, _ = groups[0]
            data = self._data(tier)[layer]
            return index_select(data, 2, ids.to(data.device)).cpu().contiguous()
        two, heads, bs, hd = self._block_shape
        out = torch.zeros((two, heads, n, bs, hd), dtype=self._dtype)
        for tier, ids, positions in groups:
            data = self._data(tier)[layer]
            index_copy(out, 2, positions, index_select(data, 2, ids.to(data.device)))
        return out

    def _send_loop(self) -> None:
        while (piece := self._pieces.get()) is not None:
            stream = piece.stream
            if stream.error is None:
                try:
                    self._send_piece(piece)
                except TransportError as e:
                    stream.error = f"{type(e).__name__}: {e}"
                except Exception as e:  # anything else must not kill the sender
                    log.exception("sending a KV stream failed")
                    stream.error = f"{type(e).__name__}: {e}"
            if piece.layer is None:
                self._finish_send(stream)

    def _send_piece(self, piece: _Piece) -> None:
        stream, send = piece.stream, piece.stream.send
        if stream.started_at is None:
            stream.started_at = self.clock()
        if piece.layer is None:
            if stream.layers_sent != self.num_layers:
                raise TransportError(f"the stream has {stream.layers_sent} of {self.num_layers} layers")
            tensor = torch.tensor([len(send.src)], dtype=torch.int64)
        elif piece.layer == _COUNT:
            tensor = torch.tensor([len(send.src)], dtype=torch.int64)
        else:
            if piece.ready is not None:
                piece.ready.synchronize()  # type: ignore[attr-defined]
            for gate in stream.gates:  # blocks loaded layerwise: send each layer as it arrives from the store
                if not gate.wait(piece.layer, self.timeout_s):
                    gate.open_all()  # its bytes are in host memory (the gate paces only their link): go on
            tensor = self._gather(stream, piece.layer)
        nbytes = tensor.numel() * tensor.element_size()
        if self.throttle is not None:
            self.throttle(nbytes)
        self.transport.send(rank_address(send.peer, self.rank), send.tag, tensor).wait(self.timeout_s)
        with self._lock:
            self.stats.bytes_sent += nbytes
        if piece.layer is not None and piece.layer != _COUNT:
            stream.layers_sent += 1

    def _finish_send(self, stream: _Outgoing) -> None:
        send = stream.send
        now = self.clock()
        with self._changed:
            if stream.error is None:
                self.stats.streams_sent += 1
                self.stats.blocks_sent += len(send.src)
                if stream.started_at is not None and stream.forward_end is not None:
                    self.stats.layerwise_streams += 1
                    self.stats.layerwise_stream_s += now - stream.started_at
                    self.stats.layerwise_exposed_s += max(0.0, now - stream.forward_end)
            else:
                self.stats.send_failures += 1
                peer = rank_address(send.peer, self.rank)
                log.warning("KV stream %d to %s failed: %s", send.send_id, peer, stream.error)
            self._done.sends.append(RemoteSendDone(send.send_id, stream.error))
            self._changed.notify_all()
