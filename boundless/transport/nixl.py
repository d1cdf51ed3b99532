"""NIXL (NVIDIA's inference transfer library; UCX underneath, over TCP on this machine).

Messages are pulled (``pull.py``): offers and acks are NIXL notifications, the bytes move by a NIXL READ.
Agents learn each other's metadata through NIXL's listener thread: an address is
``<agent name>@<host>:<port>``; the first message to or from a peer fetches its metadata and sends ours.
Memory registered for one message is pushed to the reader as partial metadata, and the read waits until
it has arrived; :meth:`register` the KV cache once instead and messages from it need neither.

Without InfiniBand devices, UCX's ib and rdmacm modules are kept from loading (``UCX_MODULES``): the
libnl-route they bring crashes the process at exit (SIGSEGV in ``rtnl_tc_unregister``, in NIXL 1.5.1).
A read from a peer that has gone fails as :class:`PeerGone`; a peer that dies before sending anything is
seen only at the receive's timeout.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Literal

import torch

from boundless.transport.base import PeerGone, TransferTimeout, TransportError, as_byte_views
from boundless.transport.base import PolledHandle as _Deadline
from boundless.transport.endpoints import TransportUnavailable
from boundless.transport.pull import PullTransport


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _keep_ucx_off_absent_rdma() -> None:
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")


class NixlTransport(PullTransport):
    """A NIXL agent named ``name`` (made unique with the process id and port); see the module docstring."""

    kind = "nixl"

    def __init__(self, name: str, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
        super().__init__()
        _keep_ucx_off_absent_rdma()
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # the package, or a library it loads
            raise TransportUnavailable(f"nixl: {e}") from e
        logging.getLogger("NIXL").setLevel(logging.WARNING)
        self.timeout_s = timeout_s
        self.port = _free_port(host)
        self.agent_name = f"{name}-{os.getpid()}-{self.port}"
        self.address = f"{self.agent_name}@{host}:{self.port}"
        config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=True, listen_port=self.port)
        try:
            self.agent = nixl_agent(self.agent_name, config)
        except Exception as e:
            raise TransportUnavailable(f"nixl agent: {e}") from e
        self._where: dict[str, tuple[str, int]] = {}  # agent name -> listener, for peers we know
        self._told: dict[str, set[int]] = {}  # agent name -> the registered regions its metadata has
        self._registered: list[tuple[int, int, object]] = []  # (address, length, descs) by register()

    def register(self, tensor: torch.Tensor) -> None:
        view = as_byte_views(tensor)[0]
        with self._lock:
            descs = self.agent.register_memory([view])
            self._registered.append((view.data_ptr(), view.numel(), descs))

    def unregister(self, tensor: torch.Tensor) -> None:
        view = as_byte_views(tensor)[0]
        with self._lock:
            for i, (a, n, descs) in enumerate(self._registered):
                if (a, n) == (view.data_ptr(), view.numel()) and descs is not None:
                    self.agent.deregister_memory(descs)
                    self._registered[i] = (0, 0, None)  # indices stay: peers' metadata is tracked by them

    def close(self) -> None:
        with self._lock:
            for _, _, descs in self._registered:
                if descs is not None:
                    self.agent.deregister_memory(descs)
            self._registered.clear()

    # -- the library --------------------------------------------------------------------------------

    def _connect(self, peer: str) -> str:
        agent, _, where = peer.partition("@")
        if agent in self._where:
            return agent
        host, _, port = where.rpartition(":")
        try:
            self.agent.fetch_remote_metadata(agent, host, int(port))
            self.agent.send_local_metadata(host, int(port))
            _Deadline(lambda: self.agent.check_remote_metadata(agent), self.timeout_s, f"metadata of {peer}").wait()
        except (TransferTimeout, Exception) as e:
            raise PeerGone(f"nixl peer {peer}: {e}") from e
        self._where[agent] = (host, int(port))
        self._told[agent] = set(range(len(self._registered)))  # our full metadata went with the connection
        return agent

    def _register_uncovered(self, views: list[torch.Tensor]) -> list:
        out = []
        for v in views:
            a, n = v.data_ptr(), v.numel()
            if n and not any(ra <= a and a + n <= ra + rn for ra, rn, _ in self._registered):
                out.append(self.agent.register_memory([v]))
        return out

    def _make_readable(self, peer: str, views: list[torch.Tensor]) -> object:
        """Register what :meth:`register` did not cover, and send the reader the metadata it lacks: it
        needs every region in our metadata before it can read it."""
        temp = self._register_uncovered(views)
        host, port = self._where[peer]
        told = self._told[peer]
        for i, (ra, rn, descs) in enumerate(self._registered):
            if i not in told and any(ra <= v.data_ptr() < ra + rn for v in views):
                self.agent.send_partial_agent_metadata(descs, False, [], host, port)
                told.add(i)
        for descs in temp:
            self.agent.send_partial_agent_metadata(descs, False, [], host, port)
        return temp

    def _make_writable(self, views: list[torch.Tensor]) -> object:
        return self._register_uncovered(views)

    def _release(self, temp: object) -> None:
        assert temp is None or isinstance(temp, list)  # (what _register_uncovered returned)
        for descs in temp or []:
            self.agent.deregister_memory(descs)

    def _notify(self, peer: str, msg: str) -> None:
        self.agent.send_notif(peer, msg.encode())

    def _notifications(self) -> list[tuple[str, str]]:
        return [(agent, m.decode()) for agent, msgs in self.agent.get_new_notifs().items() for m in msgs]

    def _start_read(self, peer: str, pieces: list[tuple[int, int, int]]) -> object | None:
        remote = self.agent.get_xfer_descs([(ra, n, 0) for _, ra, n in pieces], "DRAM")
        if not self.agent.check_remote_metadata(peer, remote):
            return None  # its registration comes by the listener, after the offer
        local = self.agent.get_xfer_descs([(la, n, 0) for la, _, n in pieces], "DRAM")
        xfer = self.agent.initialize_xfer("READ", local, remote, peer)
        if self.agent.transfer(xfer) == "ERR":
            self.agent.release_xfer_handle(xfer)
            raise PeerGone(f"nixl read from {peer} failed to start")
        return xfer

    def _read_state(self, read: object) -> TransportError | Literal[False] | None:
        state = self.agent.check_xfer_state(read)
        if state == "PROC":
            return None
        self.agent.release_xfer_handle(read)
        return False if state == "DONE" else PeerGone("nixl read failed")
