"""Publishing KV cache events on ZMQ, as vLLM's ``ZmqEventPublisher`` does, off the engine's step.

The engine hands each step's events to :meth:`ZmqEventPublisher.publish`, which only numbers the batch and puts it on
a bounded queue (a full queue drops the batch and counts it: the engine never waits for a subscriber). A thread
encodes each batch (``kv/event_wire.py``) and sends it on a PUB socket as a three-part message: the topic, the
sequence number as 8 big-endian bytes, the payload. It keeps the last ``buffer_steps`` payloads for the replay socket
(ROUTER): a request ``[identity, b"", start_seq]`` gets ``[identity, b"", topic, seq, payload]`` for each kept batch
from ``start_seq`` on, then ``[identity, b"", b"", -1, b""]`` (vLLM 0.26 on; ``event_format: array`` leaves out the
topic frames, as 0.23 did: ``kv/event_wire.py``). A dropped batch keeps its number, so a subscriber sees the gap.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from boundless.config import KVEventsConfig
from boundless.kv.event_wire import encode_batch, replay_end, replay_reply
from boundless.kv.events import KVEvent

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)

# How long the thread waits on the queue before it looks at the replay socket again.
POLL_S = 0.05
# How long close() waits for the thread to send what is queued.
CLOSE_TIMEOUT_S = 2.0


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Instance ``rank``'s endpoint (vLLM's data-parallel offset): a tcp port plus ``rank``; an ipc or inproc name with
    ``_dp<rank>`` appended. Rank 0's is the endpoint itself."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, an ipc path or an inproc name is bound; any other address is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """One engine's KV events on a PUB socket (and a ROUTER replay socket), sent from a thread of its own."""

    def __init__(self, config: KVEventsConfig, block_size: int, rank: int = 0) -> None:
        self.block_size = block_size
        self.rank = rank
        self.event_format = config.event_format
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self.dropped_batches = 0  # batches the full queue turned away
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, float, list[KVEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._numbering = threading.Lock()  # a reset from another thread than the engine's publishes too
        import zmq  # (here: an engine that publishes no events needs no pyzmq, as on a GPU machine without it)

        # Made here, so that an endpoint in use fails at start-up; used by the thread alone from then on.
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            assert self.endpoint is not None
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{rank}", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue a step's events as the next batch (stamped now, on the wall clock, as vLLM's are); never blocks."""
        with self._numbering:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            try:
                self._queue.put_nowait((seq, time.time(), events))
                return
            except queue.Full:
                self.dropped_batches += 1
        if self.dropped_batches == 1:
            log.warning("KV events: the publisher's queue is full; batches are dropped (their numbers skipped)")

    def close(self) -> None:
        """Send what is queued (for at most ``CLOSE_TIMEOUT_S``), then stop the thread and close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode_batch(ts, events, self.rank, self.block_size, self.event_format)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # a batch that fails is logged and skipped: the engine goes on
                log.exception("KV events: batch %d was not sent", seq)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored (want identity, empty, start)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", *replay_reply(self._topic, seq, payload, self.event_format)))
        self._replay.send_multipart((client, b"", *replay_end(self.event_format)))


def open_publisher(config: KVEventsConfig | None, block_size: int, rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for, or None (events off, or the ``null`` publisher: no event is made)."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config, block_size, rank)
