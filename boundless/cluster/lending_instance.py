"""An instance's side of KV lending in a Ray cluster: its agent in the engine loop, and control over Ray.

:class:`InstanceLending` puts an :class:`~boundless.engine.lending.LendingAgent` into an instance's engine loop:

- between steps (under the loop's lock) it tells the rManager the engine's state and carries out the gManager's
  orders (moves, and the deadlock breaker's holds and releases), which the router hands the actor at any time
  (:meth:`InstanceLending.order`);
- a step whose DistAttention round trip failed is dropped and its creditor taken as lost, as
  ``LendingAgent.step`` does (:meth:`InstanceLending.step_failed`);
- each heartbeat expires stale reservations and moves, and carries the rManager's report and the step times
  the engine recorded since the last one (:meth:`InstanceLending.heartbeat`).

:class:`RayControlPlane` is the :class:`~boundless.engine.lending.ControlPlane` between instances: each message
is a call on the creditor's actor, which runs the agent's handler under its own loop's lock. The protocol's
logic stays in the rManager and the agent; blocks and partials go over the KV transport, never through Ray.
A call that fails or does not answer in time counts as a refusal or a failed move (both leave both sides
consistent, ``docs/lending.md``): two debtors ordering moves to each other at once cannot wait on each other
for longer than that.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from boundless.attention.partial_service import RemotePartialError
from boundless.cluster.lending_cluster import LendingOrder
from boundless.cluster.placement import Heartbeat
from boundless.cluster.rmanager import RManager, SendBlocks, TryMove
from boundless.config import ClusterConfig
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.lending import LendingAgent
from boundless.engine.scheduler import SchedulerOutput
from boundless.transport.base import KVTransport


@dataclass(frozen=True)
class LendingSetup:
    """An instance's part in KV lending: its transport endpoint (``rank`` of ``world_size``, meeting in
    ``directory``) and the lending flags of ``cluster``."""

    cluster: ClusterConfig
    directory: str
    rank: int
    world_size: int


@dataclass(frozen=True)
class RemoteReceipt:
    """The creditor posted the move's receive; it keeps the receive itself, by move id."""

    move_id: str


class RayControlPlane:
    """The protocol's control messages as calls on the creditor's actor (see the module)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.peers: dict[str, Any] = {}  # transport address -> actor handle

    def _call(self, creditor: str, method: str, *args: Any) -> Any:
        import ray

        actor = self.peers.get(creditor)
        if actor is None:
            return None
        try:
            return ray.get(getattr(actor, method).remote(*args), timeout=self.timeout_s)
        except Exception:  # gone, hung, or raised there: the protocol treats it as no
            return None

    def try_move(self, creditor: str, action: TryMove) -> bool:
        return bool(self._call(creditor, "lend_try_move", action))

    def take_blocks(self, creditor: str, action: SendBlocks, debtor: str) -> RemoteReceipt | None:
        return RemoteReceipt(action.move_id) if self._call(creditor, "lend_take_blocks", action, debtor) else None

    def confirm_blocks(self, creditor: str, move_id: str, receive: Any) -> bool:
        return bool(self._call(creditor, "lend_confirm_blocks", move_id))

    def release(self, creditor: str, move_id: str) -> None:
        actor = self.peers.get(creditor)
        if actor is not None:
            actor.lend_release.remote(move_id)  # idempotent; nobody waits for it


class InstanceLending:
    """A lending agent in an instance's engine loop (see the module). Its methods that touch the engine run
    under ``lock``, the loop's."""

    def __init__(
        self, core: EngineCore, transport: KVTransport, address: str, setup: LendingSetup, lock: threading.Lock
    ) -> None:
        """``address``: the instance's, its ``transport``'s (a split model's: its ranks', ``lending_address``)."""
        cluster = setup.cluster
        num_blocks = core.layout.num_blocks
        rmanager = RManager(
            address,
            num_blocks,
            core.layout.block_size,
            core.clock,
            cluster.lending_reservation_timeout_s,
            headroom_blocks=int(cluster.lending_creditor_headroom * num_blocks),
        )
        # A control call waits while holding the loop's lock, which the instance's heartbeat needs too: it must
        # give up well before the router would take the instance for dead.
        self.control = RayControlPlane(timeout_s=min(cluster.kv_handoff_timeout_s, cluster.heartbeat_timeout_s / 4))
        self.agent = LendingAgent(
            core,
            rmanager,
            transport,
            self.control,
            timeout_s=cluster.kv_handoff_timeout_s,
            lookahead_chunks=cluster.lending_lookahead_chunks,
        )
        self.lock = lock
        self._orders: deque[LendingOrder] = deque()

    def connect(self, peers: dict[str, Any]) -> None:
        """The other instances' actors, by transport address."""
        self.control.peers = {a: actor for a, actor in peers.items() if a != self.agent.instance_id}

    # -- in the engine loop -------------------------------------------------------------------------------------

    def order(self, order: LendingOrder) -> None:
        """The gManager's order; carried out between steps."""
        self._orders.append(order)

    def between_steps(self) -> list[RequestDelta]:
        self.agent.observe()
        while self._orders:
            self.agent.carry_out(self._orders.popleft())
        return self.agent.take_refused()

    def step_failed(self, error: Exception, sched: SchedulerOutput) -> bool:
        """A step whose round trip to a creditor failed runs again; the creditor is taken as lost, unless the
        cluster's word came first (``LendingAgent.round_trip_failed``). False for any other error (the loop fails
        the step's requests)."""
        if not isinstance(error, RemotePartialError):
            return False
        self.agent.core.scheduler.step_failed(sched)
        self.agent.round_trip_failed(error.creditor)
        return True

    def heartbeat(self) -> Heartbeat:
        with self.lock:
            self.agent.observe()
            self.agent.apply(self.agent.rm.expire())
            return self.agent.heartbeat()

    def peer_lost(self, address: str) -> None:
        with self.lock:
            self.agent.peer_lost(address)

    def peer_back(self, address: str, actor: Any) -> None:
        """The instance at ``address`` was started again: ``actor`` is its new actor."""
        with self.lock:
            if address != self.agent.instance_id:
                self.control.peers[address] = actor
            self.agent.peer_back(address)

    # -- the creditor's handlers (calls from debtors' control planes) ----------------------------------------------

    def try_move(self, action: TryMove) -> bool:
        with self.lock:
            return self.agent.on_try_move(action)

    def take_blocks(self, action: SendBlocks, debtor: str) -> bool:
        with self.lock:
            return self.agent.on_take_blocks(action, debtor) is not None

    def confirm_blocks(self, move_id: str) -> bool:
        with self.lock:
            receive = self.agent.posted(move_id)  # (the agent keeps it: a release or an expiry frees its blocks)
            return receive is not None and self.agent.on_confirm_blocks(move_id, receive)

    def release(self, move_id: str) -> None:
        with self.lock:
            self.agent.on_release(move_id)

    def close(self) -> None:
        self.agent.close()
