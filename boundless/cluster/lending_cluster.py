"""The router's side of KV lending in a cluster: the gManager, and who is who on the transport.

The rManagers (one per instance, ``engine/lending.py``) name instances by their transport address, since that is
the peer their blocks and partials travel to; the router names them by instance id. :class:`ClusterLending`
holds the gManager and the map between the two, and turns what the cluster learns into what it must carry out:

- a heartbeat of an instance's rManager goes to the gManager (:meth:`on_heartbeat`);
- when a plan is due, each :class:`~boundless.cluster.lending_plan.MoveOrder` becomes an :class:`OrderMove` for
  its debtor's instance, and the deadlock breaker's holds and releases an :class:`OrderHold` and an
  :class:`OrderRelease` for the held request's instance, and its grants to requests longer than one pool an
  :class:`OrderGrant` for the request's instance, and its refusals of those the live instances cannot hold an
  :class:`OrderRefuse` (:meth:`orders`);
- an instance lost becomes a :class:`PeerLost` for every other live instance, whose rManager frees what it lent
  to it and recomputes what it held (:meth:`instance_lost`);
- an instance started again in a lost one's place becomes a :class:`PeerBack` for every other live instance, whose
  agent calls the new actor and may lend to it and borrow from it again (:meth:`instance_back`).

Plain code over plain data, as the dispatcher: the Ray client carries the decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass

from boundless.cluster.gmanager import GManager, InstanceLending
from boundless.cluster.placement import Heartbeat


@dataclass(frozen=True)
class OrderMove:
    """Tell ``instance_id`` (the debtor) to move ``num_blocks`` of ``request_id``'s blocks to the instance at
    transport address ``creditor``."""

    instance_id: str
    request_id: str
    num_blocks: int
    creditor: str


@dataclass(frozen=True)
class OrderHold:
    """Tell ``instance_id`` to drop ``request_id``'s KV to recompute and hold it back
    (``cluster/lending_deadlock.py``)."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class OrderRelease:
    """Tell ``instance_id`` that ``request_id``, held back, may be admitted again."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class OrderGrant:
    """Tell ``instance_id`` that ``request_id``, longer than its pool, may start (``cluster/lending_grants.py``)."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class OrderRefuse:
    """Tell ``instance_id`` to fail ``request_id``: it awaited a grant the live instances could not give it for the
    grant timeout (``cluster/lending_grants.py``)."""

    instance_id: str
    request_id: str


LendingOrder = OrderMove | OrderHold | OrderRelease | OrderGrant | OrderRefuse


@dataclass(frozen=True)
class PeerLost:
    """Tell ``instance_id``'s rManager that the instance at transport address ``lost`` is gone."""

    instance_id: str
    lost: str


@dataclass(frozen=True)
class PeerBack:
    """Tell ``instance_id``'s rManager that instance ``back``, lost before, was started again at transport address
    ``address``."""

    instance_id: str
    back: str
    address: str


class ClusterLending:
    """The gManager beside the router, with the instances' transport addresses (see the module)."""

    def __init__(self, gmanager: GManager, addresses: dict[str, str]) -> None:
        self.gm = gmanager
        self.addresses = dict(addresses)  # instance id -> transport address
        self.instance_of = {address: iid for iid, address in addresses.items()}
        self.lost: set[str] = set()

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        if self.instance_of.get(heartbeat.instance_id) not in self.lost:
            self.gm.on_heartbeat(heartbeat)

    def orders(self) -> list[LendingOrder]:
        """The moves, holds and releases of a plan, if one is due, and the grants and refusals due now (at every
        call: a heartbeat round). None to a lost instance."""
        orders: list[LendingOrder] = []
        if self.gm.due():
            plan = self.gm.plan()
            iid = self.instance_of
            orders += [OrderMove(iid[m.debtor], m.request_id, m.num_blocks, m.creditor) for m in plan.moves]
            orders += [OrderHold(iid[h.instance], h.request_id) for h in plan.holds]
            orders += [OrderRelease(iid[r.instance], r.request_id) for r in plan.releases]
        orders += [OrderGrant(self.instance_of[g.instance], g.request_id) for g in self.gm.grant()]
        orders += [OrderRefuse(self.instance_of[r.instance], r.request_id) for r in self.gm.refusals()]
        return [o for o in orders if o.instance_id not in self.lost]

    def instance_lost(self, instance_id: str) -> list[PeerLost]:
        """The instance died: the gManager forgets it, and every live instance's rManager is told."""
        if instance_id in self.lost:
            return []
        self.lost.add(instance_id)
        address = self.addresses[instance_id]
        self.gm.instance_lost(address)
        return [PeerLost(iid, address) for iid in self.addresses if iid not in self.lost]

    def instance_back(self, instance_id: str, address: str | None = None) -> list[PeerBack]:
        """A lost instance was started again (at ``address``, if its transport's address changed): the gManager hears
        its heartbeats again, and every other live instance's rManager is told. Nothing for one not lost."""
        if instance_id not in self.lost:
            return []
        self.lost.discard(instance_id)
        if address is not None and address != self.addresses[instance_id]:
            del self.instance_of[self.addresses[instance_id]]
            self.addresses[instance_id] = address
            self.instance_of[address] = instance_id
        address = self.addresses[instance_id]
        return [PeerBack(iid, instance_id, address) for iid in self.live_addresses() if iid != instance_id]

    def live_addresses(self) -> dict[str, str]:
        """Each instance not lost: its transport address."""
        return {iid: address for iid, address in self.addresses.items() if iid not in self.lost}

    def waiting_for_room(self) -> dict[str, int]:
        """Each instance's running requests whose local blocks fill its pool and that wait for a move to grow, as the
        gManager last heard them (for ``/cluster`` and ``/metrics``: a count that stays up means lending stalled)."""
        return {
            self.instance_of[a]: sum(r.waits_for_room for r in hb.requests)
            for a, hb in self.gm.heartbeats.items()
            if a in self.instance_of
        }

    def awaiting_grant(self) -> dict[str, list[str]]:
        """Each instance's requests longer than its pool waiting for the gManager's grant to start, as the gManager
        last heard them (for ``/cluster``)."""
        return {
            self.instance_of[a]: [rid for rid, _ in hb.instance.awaiting_grant]
            for a, hb in self.gm.heartbeats.items()
            if a in self.instance_of
        }

    def held(self) -> dict[str, list[str]]:
        """The requests the deadlock breaker holds back, by instance id (for ``/cluster``)."""
        out: dict[str, list[str]] = {}
        for hold in self.gm.holds.values():
            iid = self.instance_of.get(hold.instance)
            if iid is not None:
                out.setdefault(iid, []).append(hold.request_id)
        return {iid: sorted(rids) for iid, rids in out.items()}

    def lending(self) -> dict[str, InstanceLending]:
        """Blocks lent, reserved and borrowed per instance id, as the gManager last heard them."""
        return {self.instance_of[a]: view for a, view in self.gm.lending().items() if a in self.instance_of}
