"""Mooncake's transfer engine (``mooncake-transfer-engine-non-cuda``: host memory over TCP).

Messages are pulled (``pull.py``). The engine runs with ``P2PHANDSHAKE`` metadata (no etcd: peers
exchange segment descriptors directly), so a peer is its RPC endpoint ``host:port``; each endpoint also
registers a small scratch buffer that notifications are written to (a zero-length write carrying a
``TransferNotify``: the engine has no other way to send one), so an address is
``<host>:<port>/<scratch address>``. Reads are ``batch_transfer_sync_read`` on waiter threads (the engine's
``get_batch_transfer_status`` blocks, and frees the batch, so it cannot be polled); a read that fails,
such as from a peer that has gone, raises :class:`PeerGone`. Registration is checked by the serving side
at each request, so memory registered for one message needs no metadata pushed.

The wheel's engine links libibverbs even for TCP (``apt-get install libibverbs1``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from boundless.transport.base import PeerGone, TransportError, as_byte_views
from boundless.transport.endpoints import TransportUnavailable
from boundless.transport.pull import PullTransport


class MooncakeTransport(PullTransport):
    """A Mooncake transfer engine on ``host`` over TCP; see the module docstring."""

    kind = "mooncake"

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
        super().__init__()
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except Exception as e:  # the package, or libibverbs it links
            raise TransportUnavailable(f"mooncake: {e}") from e
        self._notify_cls, self._write = TransferNotify, TransferOpcode.Write
        self.timeout_s = timeout_s
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransportUnavailable(f"mooncake: initialize returned {rc}")
        self._scratch = torch.zeros(64, dtype=torch.uint8)
        self._registered: list[tuple[int, int]] = []
        self.register(self._scratch)
        self.address = f"{host}:{self.engine.get_rpc_port()}/{self._scratch.data_ptr()}"
        self._readers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="mooncake-read")

    def register(self, tensor: torch.Tensor) -> None:
        view = as_byte_views(tensor)[0]
        with self._lock:
            if self.engine.register_memory(view.data_ptr(), view.numel()) != 0:
                raise TransportError("mooncake: register_memory failed")
            self._registered.append((view.data_ptr(), view.numel()))

    def unregister(self, tensor: torch.Tensor) -> None:
        view = as_byte_views(tensor)[0]
        with self._lock:
            if (view.data_ptr(), view.numel()) in self._registered:
                self.engine.unregister_memory(view.data_ptr())
                self._registered.remove((view.data_ptr(), view.numel()))

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for a, _ in self._registered:
                self.engine.unregister_memory(a)
            self._registered.clear()

    # -- the library --------------------------------------------------------------------------------

    @staticmethod
    def _session(peer: str) -> tuple[str, int]:
        session, _, scratch = peer.rpartition("/")
        return session, int(scratch)

    def _connect(self, peer: str) -> str:
        return peer  # the engine connects on first use; notifications name us by our address

    def _register_uncovered(self, views: list[torch.Tensor]) -> list[int]:
        out = []
        for v in views:
            a, n = v.data_ptr(), v.numel()
            if n and not any(ra <= a and a + n <= ra + rn for ra, rn in self._registered):
                if self.engine.register_memory(a, n) != 0:
                    raise TransportError("mooncake: register_memory failed")
                out.append(a)
        return out

    def _make_readable(self, peer: str, views: list[torch.Tensor]) -> object:
        return self._register_uncovered(views)

    def _make_writable(self, views: list[torch.Tensor]) -> object:
        return self._register_uncovered(views)

    def _release(self, temp: object) -> None:
        assert temp is None or isinstance(temp, list)  # (what _register_uncovered returned)
        for a in temp or []:
            self.engine.unregister_memory(a)

    def _notify(self, peer: str, msg: str) -> None:
        session, scratch = self._session(peer)
        notify = self._notify_cls(self.address, msg)
        rc = self.engine.transfer_sync(session, self._scratch.data_ptr(), scratch, 0, self._write, notify)
        if rc != 0:
            raise PeerGone(f"mooncake peer {peer}: notification failed ({rc})")

    def _notifications(self) -> list[tuple[str, str]]:
        return [(n.name, n.msg) for n in self.engine.get_notifies()]

    def _start_read(self, peer: str, pieces: list[tuple[int, int, int]]) -> object | None:
        session, _ = self._session(peer)
        local, remote, lengths = ([p[i] for p in pieces] for i in range(3))
        return self._readers.submit(self.engine.batch_transfer_sync_read, session, local, remote, lengths)

    def _read_state(self, read: object) -> TransportError | Literal[False] | None:
        assert isinstance(read, Future)
        if not read.done():
            return None
        rc = read.result()
        return False if rc == 0 else PeerGone(f"mooncake read failed ({rc})")
