"""The cluster's KV-lending planner (Infinite-LLM's gManager), one beside the router.

It takes each instance's heartbeat from its rManager (``cluster/rmanager.py``): the instance's free blocks,
batch and context, its running requests with where their blocks live, and the step times its engine recorded.
From these it keeps the request placement map (which instance holds how many blocks of which request), the
lending per instance (for ``/cluster``), and a window of step samples to which it fits the performance model
(``cluster/perf_model.py``). Every ``interval_s`` it plans moves with the greedy Algorithm 1
(``cluster/lending_plan.py``) and hands them out as :class:`~boundless.cluster.lending_plan.MoveOrder` s for
the debtors' rManagers to carry out with the try/move protocol.

It plans only from fresh state: every live instance must have reported since the last plan (so blocks ordered
moved are not ordered again from a stale view), and instances silent past ``heartbeat_timeout_s`` take no part.
Until the samples determine the model it plans no move by it; a request that waits for room (its local blocks
fill its pool) is lent what a creditor may lend, model or not (``lending_plan.room_moves``).

When requests that wait for room deadlock (``cluster/lending_deadlock.py``), a plan also holds one back, and a
later plan releases it once those it yielded to are gone. At every heartbeat round (:meth:`grant`, not only when
a plan is due) it grants the requests longer than one pool that may start now, their instances and creditors taken
by no other grant (``cluster/lending_grants.py``), and fails those the live instances have not been able to hold
for ``grant_timeout_s`` (:meth:`refusals`). Pure, like the dispatcher: no I/O, no threads, time only from
the injected clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from boundless.cluster.lending_deadlock import find_deadlock
from boundless.cluster.lending_grants import plan_grants, ungrantable
from boundless.cluster.lending_plan import (
    GrantOrder,
    HoldOrder,
    LendingPlan,
    LendingThresholds,
    RefuseOrder,
    ReleaseOrder,
    plan_lending,
    room_moves,
)
from boundless.cluster.perf_model import NotEnoughSamplesError, fit_step_time_model
from boundless.cluster.placement import Heartbeat, RequestPlacementEntry
from boundless.config import ClusterConfig
from boundless.engine.attention_time import AttentionSample, AttentionTimeModel

# Step samples kept across the cluster for the fit: the latest few thousand steps.
MAX_SAMPLES = 4096


@dataclass(frozen=True)
class InstanceLending:
    """One instance's lending as the gManager last heard it, in blocks."""

    lent: int  # held for other instances' requests
    reserved: int  # promised to a move under way
    borrowed: int  # of its own requests' blocks, those held elsewhere
    free: int
    total: int


@dataclass
class GManagerCounters:
    plans: int = 0
    moves_ordered: int = 0
    blocks_ordered: int = 0
    holds_ordered: int = 0  # by the deadlock breaker (one an instance refused, its request no longer waiting, too)
    grants_ordered: int = 0  # to requests longer than one pool (cluster/lending_grants.py)
    grants_refused: int = 0  # requests the live instances could not hold for the grant timeout, failed


class GManager:
    """Heartbeats in, lending plans out (see the module)."""

    def __init__(
        self,
        thresholds: LendingThresholds,
        interval_s: float,
        heartbeat_timeout_s: float,
        clock: Callable[[], float],
        max_samples: int = MAX_SAMPLES,
        grant_timeout_s: float = 60.0,
    ) -> None:
        self.thresholds = thresholds
        self.interval_s = interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.heartbeats: dict[str, Heartbeat] = {}
        self._heard_at: dict[str, float] = {}
        self._samples: deque[AttentionSample] = deque(maxlen=max_samples)
        self._model: AttentionTimeModel | None = None
        self._model_stale = False
        self._last_plan_at: float | None = None
        self.counters = GManagerCounters()
        self.holds: dict[str, HoldOrder] = {}  # by request: held back by the deadlock breaker, not yet released
        # For the breaker's choice of victim: how often each request was held, and the order requests were first
        # heard of in; forgotten once a request is neither held nor reported for a heartbeat timeout (a released
        # one is reported again as soon as its instance has its release).
        self.times_held: dict[str, int] = {}
        self.arrival: dict[str, int] = {}
        self._last_reported: dict[str, float] = {}
        self._arrivals = 0
        self.grants: dict[str, tuple[GrantOrder, float]] = {}  # by request: in force, with when it was given
        # Requests awaiting a grant no arrangement of the live instances could give, with since when; failed past
        # ``grant_timeout_s`` (:meth:`refusals`).
        self.ungrantable_since: dict[str, float] = {}
        self.grant_timeout_s = grant_timeout_s

    @classmethod
    def from_config(cls, config: ClusterConfig, clock: Callable[[], float]) -> GManager:
        thresholds = LendingThresholds.from_config(config)
        return cls(
            thresholds,
            config.lending_interval_s,
            config.heartbeat_timeout_s,
            clock,
            grant_timeout_s=config.lending_grant_timeout_s,
        )

    # -- what it is told --------------------------------------------------------------------------------------

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.heartbeats[heartbeat.instance_id] = heartbeat
        now = self._heard_at[heartbeat.instance_id] = self.clock()
        report = heartbeat.instance
        for request_id in (
            *(r.request_id for r in heartbeat.requests),
            *report.queued,
            *(rid for rid, _ in report.awaiting_grant),
        ):
            if request_id not in self.arrival:
                self._arrivals += 1
                self.arrival[request_id] = self._arrivals
            self._last_reported[request_id] = now
        if heartbeat.step_samples:
            self._samples.extend(heartbeat.step_samples)
            self._model_stale = True

    def instance_lost(self, instance_id: str) -> None:
        """The instance is gone: it neither borrows nor lends any more (its rManager's peers free and recompute)."""
        self.heartbeats.pop(instance_id, None)
        self._heard_at.pop(instance_id, None)
        self.holds = {rid: h for rid, h in self.holds.items() if h.instance != instance_id}  # recomputed anywhere
        # Its requests are recomputed elsewhere (granted anew there); it lends to no grant any more.
        self.grants = {
            rid: (g, at)
            for rid, (g, at) in self.grants.items()
            if g.instance != instance_id and instance_id not in g.creditors
        }

    # -- what it knows ----------------------------------------------------------------------------------------

    def live(self) -> list[Heartbeat]:
        """The latest heartbeat of each instance heard from within the timeout."""
        now = self.clock()
        return [hb for iid, hb in self.heartbeats.items() if now - self._heard_at[iid] <= self.heartbeat_timeout_s]

    def model(self) -> AttentionTimeModel | None:
        """The performance model fitted to the samples so far; None until they determine it."""
        if self._model_stale:
            self._model_stale = False
            try:
                self._model = fit_step_time_model(list(self._samples))
            except NotEnoughSamplesError:
                self._model = None
        return self._model

    def placement(self) -> dict[str, list[RequestPlacementEntry]]:
        """The request placement map: for each running request, where its blocks live."""
        return {r.request_id: r.entries() for hb in self.heartbeats.values() for r in hb.requests}

    def lending(self) -> dict[str, InstanceLending]:
        """Blocks lent, reserved and borrowed per instance, for ``/cluster``."""
        out = {}
        for iid, hb in self.heartbeats.items():
            r = hb.instance
            out[iid] = InstanceLending(
                r.lent_blocks, r.reserved_blocks, r.borrowed_blocks, r.free_blocks, r.total_blocks
            )
        return out

    # -- what it decides --------------------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether a plan is due: the interval has passed and every live instance reported since the last plan."""
        if self._last_plan_at is None:
            return bool(self.heartbeats)
        if self.clock() - self._last_plan_at < self.interval_s:
            return False
        live = [hb.instance_id for hb in self.live()]
        return bool(live) and all(self._heard_at[iid] > self._last_plan_at for iid in live)

    def plan(self) -> LendingPlan:
        """Plan moves over the live instances now (by the model once it is fitted; for requests waiting for room,
        whatever a creditor may lend, model or not: ``room_moves``), and the deadlock breaker's holds and
        releases."""
        self._last_plan_at = self.clock()
        model = self.model()
        live = self.live()
        reports = [hb.instance for hb in live]
        requests = [r for hb in live for r in hb.requests]
        result = LendingPlan((), 0.0, 0.0)
        planned = model is not None and len(live) >= 2
        if planned:
            result = plan_lending(reports, requests, model, self.thresholds)
            self.counters.plans += 1
        room = room_moves(reports, requests, self.thresholds, result.moves) if len(live) >= 2 else ()
        moves = result.moves + room
        self.counters.moves_ordered += len(moves)
        self.counters.blocks_ordered += sum(m.num_blocks for m in moves)
        holds: tuple[HoldOrder, ...] = ()
        if not moves:
            # Whatever any instance may lend, the room moves offered it to the waiting requests: none could take it.
            hold = find_deadlock(reports, requests, self.thresholds, True, self.times_held, self.arrival)
            if hold is not None:
                holds = (hold,)
                self.holds[hold.request_id] = hold
                self.times_held[hold.request_id] = self.times_held.get(hold.request_id, 0) + 1
                self.counters.holds_ordered += 1
        releases = self._releases(live)
        self._forget()
        return LendingPlan(moves, result.throughput_before, result.throughput_after, holds, releases)

    def grant(self) -> tuple[GrantOrder, ...]:
        """End the grants whose request no live instance reports since the grant (finished, or lost), then give
        the grants due now (``cluster/lending_grants.py``). Called at every heartbeat round, not only when a plan is
        due: a request awaiting a grant holds nothing and runs nothing, so each interval waited is lost."""
        live = self.live()
        present = _reported(live) | self.holds.keys()
        present |= {rid for hb in live for rid, _ in hb.instance.awaiting_grant}
        heard_since = min((self._heard_at[hb.instance_id] for hb in live), default=0.0)
        for rid, (_, at) in list(self.grants.items()):
            if rid not in present and heard_since > at:  # every instance reported after it, and none has it
                del self.grants[rid]
        now = self.clock()
        grants = plan_grants(
            [hb.instance for hb in live], [g for g, _ in self.grants.values()], self.thresholds, self.arrival
        )
        for grant in grants:
            self.grants[grant.request_id] = (grant, now)
        self.counters.grants_ordered += len(grants)
        return grants

    def refusals(self) -> tuple[RefuseOrder, ...]:
        """The requests awaiting a grant that the live instances could not hold (``lending_grants.ungrantable``) for
        ``grant_timeout_s`` together: their instance fails them (a lost instance that came back within it, or one
        that had not reported yet, lets them start). Called at every heartbeat round, after :meth:`grant`."""
        now = self.clock()
        stuck = dict(ungrantable([hb.instance for hb in self.live()], self.thresholds))
        self.ungrantable_since = {rid: self.ungrantable_since.get(rid, now) for rid in stuck}
        due = [rid for rid, since in self.ungrantable_since.items() if now - since >= self.grant_timeout_s]
        for rid in due:
            del self.ungrantable_since[rid]
        self.counters.grants_refused += len(due)
        return tuple(RefuseOrder(rid, stuck[rid]) for rid in sorted(due))

    def _forget(self) -> None:
        """Drop the victim-choice records of requests neither held nor reported for a heartbeat timeout (finished,
        or lost with their instance)."""
        now = self.clock()
        for rid in self.holds:  # no instance reports a held request: the hold stands for it
            self._last_reported[rid] = now
        since = now - self.heartbeat_timeout_s
        gone = [rid for rid, t in self._last_reported.items() if t < since]
        for rid in gone:
            del self._last_reported[rid]
            self.arrival.pop(rid, None)
            self.times_held.pop(rid, None)

    def _releases(self, live: list[Heartbeat]) -> tuple[ReleaseOrder, ...]:
        """The held requests none of whose yielded-to requests is on a live instance any more (running or queued)."""
        present = _reported(live)
        done = [h for h in self.holds.values() if not h.yields_to & present]
        for h in done:
            del self.holds[h.request_id]
        return tuple(ReleaseOrder(h.request_id, h.instance) for h in done)


def _reported(live: list[Heartbeat]) -> set[str]:
    """The requests these heartbeats name running or queued (not those held back, nor those awaiting a grant)."""
    return {r.request_id for hb in live for r in hb.requests} | {q for hb in live for q in hb.instance.queued}
