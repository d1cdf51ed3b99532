"""DistAttention's round trip between instances: the creditor's partial-attention service and the debtor's client.

The debtor (:class:`PartialClient`) sends, per layer and creditor, the query rows of its requests whose blocks
that creditor holds; the creditor's :class:`PartialServer` computes their partials over its lent blocks
(:func:`~boundless.attention.remote_partials.lent_partial`) and sends them back; the debtor merges them with
its own partial (``attention/dist_attention.py``). Both run over a real
:class:`~boundless.transport.base.KVTransport` with the messages of ``attention/remote_partials.py``.

The server runs on a thread of its own, so a creditor answers while its own engine steps (its forward pass
writes other blocks of the same caches; the lent blocks belong to no request there, so nothing writes them
while they are read). It listens to the debtors it is told of (:meth:`PartialServer.add_peer`), one header
receive posted per debtor, and polls them; a debtor whose transport reports it gone is dropped and reported
to ``on_peer_lost``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from boundless.attention.partials import AttentionPartial
from boundless.attention.remote_partials import (
    HEADER_LEN,
    REQUEST_TAG,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_UNKNOWN_MOVE,
    VERSION,
    LentBlocks,
    QuerySegment,
    decode_segments,
    encode_segments,
    lent_partial,
    reply_tag,
    request_header,
)
from boundless.transport.base import KVTransport, PeerGone, TransferHandle, TransportError
from boundless.transport.endpoints import rank_address

log = logging.getLogger(__name__)

# The server's poll of its debtors: fast while requests come (a step's layers follow each other), slower idle.
_BUSY_POLL_S = 50e-6
_IDLE_POLL_S = 1e-3
_BUSY_WINDOW_S = 0.05


def poll_wait(handle: TransferHandle, timeout_s: float, pause_s: float = 20e-6) -> None:
    """Wait for a small message by polling ``done`` every ``pause_s``: a transport's own wait may sleep up to a
    millisecond between polls, which a round trip per layer cannot afford. Times out as a wait does."""
    deadline = time.monotonic() + timeout_s
    while not handle.done():
        if time.monotonic() >= deadline:
            handle.wait(0)  # the transport's own timeout path: cancels the receive, raises TransferTimeout
            return
        time.sleep(pause_s)


class RemotePartialError(RuntimeError):
    """A creditor could not answer (it holds no such blocks, it failed, or it is gone)."""

    def __init__(self, creditor: str, message: str) -> None:
        super().__init__(f"creditor {creditor}: {message}")
        self.creditor = creditor


@dataclass
class PartialStats:
    """One side's DistAttention round trips so far (cumulative)."""

    round_trips: int = 0  # requests answered (server) or completed (client)
    rows: int = 0  # query rows sent or served
    bytes_sent: int = 0
    bytes_received: int = 0
    errors: int = 0
    # Client: seconds from sending a request to its reply, summed; and of those, the seconds the debtor waited
    # after its local partial was done (what overlapping with local compute did not hide).
    round_trip_s: float = 0.0
    exposed_s: float = 0.0
    per_layer_exposed_s: dict[int, float] = field(default_factory=dict)
    # Server: seconds spent computing partials.
    compute_s: float = 0.0


class PartialServer:
    """A creditor's partial-attention service over ``transport``.

    ``layer_cache(i)`` gives layer ``i``'s (k_cache, v_cache); ``lookup(move_id)`` the blocks lent under that
    move, or None; ``scale`` is the model's softmax scale (``ModelArch.attention_scale``), ``softcap`` its cap of the
    scaled scores (Gemma 2's), or None.
    """

    def __init__(
        self,
        transport: KVTransport,
        layer_cache: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        lookup: Callable[[str], LentBlocks | None],
        scale: float,
        timeout_s: float = 30.0,
        on_peer_lost: Callable[[str], None] | None = None,
        softcap: float | None = None,
    ) -> None:
        self.transport = transport
        self.layer_cache = layer_cache
        self.lookup = lookup
        self.scale = scale
        self.softcap = softcap
        self.timeout_s = timeout_s
        self.on_peer_lost = on_peer_lost
        self.stats = PartialStats()
        self._lock = threading.Lock()
        self._headers: dict[str, tuple[torch.Tensor, TransferHandle]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="partial-server", daemon=True)
        self._thread.start()

    def add_peer(self, peer: str) -> None:
        """Serve requests from ``peer`` (a debtor with blocks here); idempotent."""
        with self._lock:
            if peer not in self._headers:
                self._headers[peer] = self._post_header(peer)

    def _post_header(self, peer: str) -> tuple[torch.Tensor, TransferHandle]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        return header, self.transport.recv(peer, REQUEST_TAG, header)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        last_busy = 0.0
        while not self._stopped.is_set():
            with self._lock:
                posted = list(self._headers.items())
            served = False
            for peer, (header, handle) in posted:
                try:
                    if not handle.done():
                        continue
                except TransportError as e:
                    self._drop(peer, e)
                    continue
                try:
                    self._serve(peer, header)
                except TransportError as e:
                    self._drop(peer, e)
                served = True
            now = time.monotonic()
            if served:
                last_busy = now
            time.sleep(_BUSY_POLL_S if now - last_busy < _BUSY_WINDOW_S else _IDLE_POLL_S)

    def _drop(self, peer: str, error: TransportError) -> None:
        with self._lock:
            self._headers.pop(peer, None)
        log.info("partial server: debtor %s dropped: %s", peer, error)
        if isinstance(error, PeerGone) and self.on_peer_lost is not None:
            self.on_peer_lost(peer)

    def _serve(self, peer: str, header: torch.Tensor) -> None:
        version, seq, layer, t, h, d, s, b, window = (int(x) for x in header.tolist())
        if version != VERSION:
            raise TransportError(f"partial request of version {version} from {peer}")
        rows, lens, firsts = (torch.empty(s, dtype=torch.int64) for _ in range(3))
        ids, q = torch.empty(b, dtype=torch.uint8), torch.empty(t, h, d, dtype=torch.float32)
        body = self.transport.recv(peer, REQUEST_TAG, [rows, lens, firsts, ids, q])
        # The next header is posted only now: messages on one tag match receives in the order posted.
        with self._lock:
            if peer in self._headers:
                self._headers[peer] = self._post_header(peer)
        poll_wait(body, self.timeout_s)
        start = time.perf_counter()
        status = torch.tensor([STATUS_OK, seq], dtype=torch.int64)
        m, e, o = torch.zeros(t, h, 1), torch.zeros(t, h, 1), torch.zeros(t, h, d)
        try:
            with torch.inference_mode():
                k_cache, v_cache = self.layer_cache(layer)
                at = 0
                for segment in decode_segments(rows, lens, firsts, ids):
                    blocks = self._blocks_of(segment)
                    if blocks is None:
                        status[0] = STATUS_UNKNOWN_MOVE
                        break
                    part = lent_partial(
                        q[at : at + segment.num_rows], k_cache, v_cache, blocks, self.scale, window or None,
                        segment.first_position, self.softcap,
                    )  # fmt: skip
                    m[at : at + segment.num_rows] = part.m
                    e[at : at + segment.num_rows] = part.e
                    o[at : at + segment.num_rows] = part.o
                    at += segment.num_rows
        except Exception:  # answered as a failure: the debtor must not wait for a reply that never comes
            log.exception("partial server: request %d from %s failed", seq, peer)
            status[0] = STATUS_FAILED
        self.stats.compute_s += time.perf_counter() - start
        # (Counted before the reply goes: the debtor counts its round trip once the reply lands, which may be before
        # this thread runs again, and a reader of both counts after a step must find them equal.)
        self.stats.round_trips += 1
        self.stats.rows += t
        self.stats.bytes_received += (HEADER_LEN + 3 * s) * 8 + b + q.numel() * 4
        self.stats.bytes_sent += 16 + (m.numel() + e.numel() + o.numel()) * 4
        if status[0] != STATUS_OK:
            self.stats.errors += 1
        self.transport.send(peer, reply_tag(seq), [status, m, e, o]).wait(self.timeout_s)

    def _blocks_of(self, segment: QuerySegment) -> list[int] | None:
        blocks: list[int] = []
        for move_id in segment.move_ids:
            lent = self.lookup(move_id)
            if lent is None:
                return None
            blocks.extend(lent.block_ids)
        return blocks


@dataclass
class PendingPartial:
    """A request in flight to one creditor; :meth:`PartialClient.collect` finishes it."""

    creditor: str
    layer: int
    seq: int
    sent_at: float
    sends: list[TransferHandle]
    reply: TransferHandle
    status: torch.Tensor
    partial: AttentionPartial


class PartialClient:
    """A debtor's side of the round trip: :meth:`send` the query rows to a creditor, :meth:`collect` the partial.
    Creditors are named by their instance's address; a split model's rank ``rank`` asks the creditor's rank of its
    number (``transport/endpoints.py``), for its own heads."""

    def __init__(self, transport: KVTransport, timeout_s: float = 30.0, rank: int = 0) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.rank = rank
        self.stats = PartialStats()
        self._seq: dict[str, int] = {}

    def send(
        self,
        creditor: str,
        layer: int,
        q: torch.Tensor,
        segments: Sequence[QuerySegment],
        encoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        window: int | None = None,
    ) -> PendingPartial:
        """Ask ``creditor`` for the partials of ``q`` [T, heads, head_dim] (fp32, the segments' rows in order) in a
        layer of sliding ``window`` (None: none); ``encoded`` is ``encode_segments(segments)`` made once for every
        layer of a step."""
        seq = self._seq.get(creditor, 0)
        self._seq[creditor] = seq + 1
        peer = rank_address(creditor, self.rank)
        t, h, d = q.shape
        rows, lens, firsts, ids = encoded if encoded is not None else encode_segments(segments)
        header = request_header(seq, layer, t, h, d, len(segments), ids.numel(), window)
        q = q.float().contiguous()
        # Normal tensors even inside the forward pass's inference mode: the transport's thread writes them.
        with torch.inference_mode(False):
            status = torch.empty(2, dtype=torch.int64)
            part = AttentionPartial(m=torch.empty(t, h, 1), e=torch.empty(t, h, 1), o=torch.empty(t, h, d))
            # The reply's receive is posted before the request goes, so it is there whenever the reply comes.
            reply = self.transport.recv(peer, reply_tag(seq), [status, part.m, part.e, part.o])
        sent_at = time.perf_counter()
        sends = [
            self.transport.send(peer, REQUEST_TAG, header),
            self.transport.send(peer, REQUEST_TAG, [rows, lens, firsts, ids, q]),
        ]
        self.stats.bytes_sent += header.numel() * 8 + 3 * rows.numel() * 8 + ids.numel() + q.numel() * 4
        self.stats.rows += t
        return PendingPartial(creditor, layer, seq, sent_at, sends, reply, status, part)

    def collect(self, pending: PendingPartial) -> AttentionPartial:
        """Wait for the creditor's partial (raises :class:`RemotePartialError` when it cannot give it)."""
        try:
            poll_wait(pending.reply, self.timeout_s)
            for handle in pending.sends:  # done by now: the reply answers them
                handle.wait(self.timeout_s)
        except TransportError as e:
            self.stats.errors += 1
            raise RemotePartialError(pending.creditor, str(e)) from e
        self.stats.round_trips += 1
        self.stats.round_trip_s += time.perf_counter() - pending.sent_at
        p = pending.partial
        self.stats.bytes_received += 16 + (p.m.numel() + p.e.numel() + p.o.numel()) * 4
        code, seq = (int(x) for x in pending.status.tolist())
        if code != STATUS_OK or seq != pending.seq:
            self.stats.errors += 1
            raise RemotePartialError(pending.creditor, f"answered status {code} to request {pending.seq}")
        return p
