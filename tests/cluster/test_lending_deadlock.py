"""KV lending's deadlock breaker: which states are deadlocks, which request is held back, and when the gManager
releases it (cluster/lending_deadlock.py, cluster/gmanager.py); its orders beside the router."""

from __future__ import annotations

import dataclasses

from lending_cases import GPU_LIKE, ManualClock, heartbeat, instance, request, samples_of

from boundless.cluster.gmanager import GManager
from boundless.cluster.lending_cluster import ClusterLending, OrderHold, OrderMove, OrderRelease
from boundless.cluster.lending_deadlock import find_deadlock
from boundless.cluster.lending_plan import HoldOrder, LendingThresholds, ReleaseOrder
from boundless.cluster.placement import Heartbeat, InstanceReport, RequestReport

THRESHOLDS = LendingThresholds()


def waiting_for_room(rid: str, iid: str, blocks: int, remote: tuple[tuple[str, int], ...] = ()) -> RequestReport:
    """A request whose local blocks fill its instance's 48-block pool and that has more to compute."""
    return dataclasses.replace(request(rid, iid, blocks), remote=remote, waits_for_room=True)


def full(iid: str) -> InstanceReport:
    """An instance whose pool one request fills: nothing runs there (the request is out of the batch)."""
    return instance(iid, 48, 48, batch=0, context=48 * 16, waiting=[4])


def test_two_requests_that_fill_their_pools_with_nowhere_to_lend_are_a_deadlock() -> None:
    a, b = waiting_for_room("a", "A", 48), waiting_for_room("b", "B", 48, remote=(("A", 0),))
    hold = find_deadlock([full("A"), full("B")], [a, b], THRESHOLDS)
    # The one with the fewest blocks is held (the least to recompute; ties by id), yielding to the other.
    assert hold == HoldOrder("a", "A", frozenset({"b"}))
    b_borrowed = waiting_for_room("b", "B", 40, remote=(("A", 20),))
    assert find_deadlock([full("A"), full("B")], [a, b_borrowed], THRESHOLDS) == HoldOrder("a", "A", frozenset({"b"}))
    a_small = waiting_for_room("a", "A", 48)
    b_small = waiting_for_room("b", "B", 30)
    assert find_deadlock([full("A"), full("B")], [a_small, b_small], THRESHOLDS).request_id == "b"


def test_one_request_waiting_for_room_beside_a_queued_one_that_needs_its_pool_is_a_deadlock() -> None:
    """Seen in a real run: A's request fills A's pool and waits for room; a request swapped out on A has its
    leading blocks on B, whose pool they fill (B is no creditor), and B's own queued request waits for room there.
    Nothing runs and nothing can be lent. Holding A's request back lets the swapped one in: it ends, B's blocks free."""
    a = waiting_for_room("a", "A", 48)
    swapped_here = dataclasses.replace(full("A"), queued=("swapped",))
    lender = dataclasses.replace(instance("B", 48, 43, batch=0, context=43 * 16), lent_blocks=43, queued=("b",))
    hold = find_deadlock([swapped_here, lender], [a], THRESHOLDS)
    assert hold == HoldOrder("a", "A", frozenset({"swapped", "b"}))  # it yields to every request there


def test_no_deadlock_while_anything_can_still_change() -> None:
    a, b = waiting_for_room("a", "A", 48), waiting_for_room("b", "B", 48)
    # One request waiting alone is not a deadlock (it waits for a creditor, or is too long for the cluster).
    assert find_deadlock([full("A"), full("B")], [a], THRESHOLDS) is None
    # A step runs somewhere: it may end a request and free memory.
    running = instance("C", 48, 40, batch=2, context=600)
    assert find_deadlock([full("A"), full("B"), running], [a, b], THRESHOLDS) is None
    # A move is under way: its blocks are reserved on the creditor.
    reserving = dataclasses.replace(full("B"), reserved_blocks=4)
    assert find_deadlock([full("A"), reserving], [a, b], THRESHOLDS) is None
    # An idle instance can lend: the planner moves blocks.
    idle = instance("C", 48, 0, batch=0, context=0)
    assert find_deadlock([full("A"), full("B"), idle], [a, b], THRESHOLDS) is None
    # A request that cannot grow but does not fill its pool: its scheduler evicts it (or another) to make room,
    # though its instance's batch is empty now.
    stalled = request("c", "C", 30)
    assert find_deadlock([full("A"), full("B"), instance("C", 48, 48, 0, 480)], [a, b, stalled], THRESHOLDS) is None
    # Above the creditor usage threshold nothing is lent, so a busy-but-idle pool does not stop the breaker.
    used = instance("C", 48, 40, batch=0, context=0)
    assert find_deadlock([full("A"), full("B"), used], [a, b], THRESHOLDS) is not None
    # Room too small for either's next chunk: the planner, with a model, moved nothing, so it does not stop it.
    little = instance("C", 48, 40, batch=0, context=0)
    loose = dataclasses.replace(THRESHOLDS, creditor_max_usage=0.9)
    assert find_deadlock([full("A"), full("B"), little], [a, b], loose) is None  # no plan yet: wait for one
    assert find_deadlock([full("A"), full("B"), little], [a, b], loose, planned=True) is not None


def beat(report: InstanceReport, *requests: RequestReport) -> Heartbeat:
    return heartbeat(report, *requests, samples=samples_of(GPU_LIKE))


def test_the_gmanager_holds_one_back_and_releases_it_once_those_it_yielded_to_are_gone() -> None:
    clock = ManualClock(10.0)
    lending = ClusterLending(GManager(THRESHOLDS, 2.0, 5.0, clock), {"0": "A", "1": "B"})
    a, b = waiting_for_room("a", "A", 48), waiting_for_room("b", "B", 47)
    lending.on_heartbeat(beat(dataclasses.replace(full("A"), queued=("q",)), a))
    lending.on_heartbeat(beat(full("B"), b))
    assert lending.orders() == [OrderHold("1", "b")]
    assert lending.gm.holds == {"b": HoldOrder("b", "B", frozenset({"a", "q"}))}
    assert lending.gm.counters.holds_ordered == 1 and lending.held() == {"1": ["b"]}
    assert lending.waiting_for_room() == {"0": 1, "1": 1}
    # B dropped b: its pool is free, and the next plan lends it to a.
    clock.now += 2.0
    lending.on_heartbeat(beat(full("A"), a))
    lending.on_heartbeat(beat(instance("B", 48, 0, batch=0, context=0)))
    orders = lending.orders()
    assert len(orders) == 1 and isinstance(orders[0], OrderMove) and orders[0].instance_id == "0"
    # a runs on, with blocks on B (q, queued behind it, too): b stays held.
    clock.now += 2.0
    a_running = dataclasses.replace(a, local_blocks=40, remote=(("B", 30),), waits_for_room=False)
    lending.on_heartbeat(beat(instance("A", 48, 40, batch=1, context=1100), a_running))
    lending.on_heartbeat(beat(dataclasses.replace(instance("B", 48, 30, batch=0, context=480), lent_blocks=30)))
    assert not any(isinstance(o, OrderRelease) for o in lending.orders())
    # a finished, but a request queued on A when b was held is still there: b waits for it too.
    clock.now += 2.0
    lending.on_heartbeat(beat(dataclasses.replace(instance("A", 48, 0, batch=0, context=0), queued=("q",))))
    lending.on_heartbeat(beat(instance("B", 48, 0, batch=0, context=0)))
    assert lending.orders() == []
    # it ran and finished: b may be admitted again.
    clock.now += 2.0
    lending.on_heartbeat(beat(instance("A", 48, 0, batch=0, context=0)))
    lending.on_heartbeat(beat(instance("B", 48, 0, batch=0, context=0)))
    assert lending.orders() == [OrderRelease("1", "b")]
    assert lending.gm.holds == {} and lending.held() == {} and lending.waiting_for_room() == {"0": 0, "1": 0}


def test_a_hold_is_dropped_with_its_instance_and_released_when_those_it_yielded_to_are_lost() -> None:
    clock = ManualClock(10.0)
    gm = GManager(THRESHOLDS, 2.0, 5.0, clock)
    c = waiting_for_room("c", "C", 48)
    gm.on_heartbeat(beat(full("A"), waiting_for_room("a", "A", 48)))
    gm.on_heartbeat(beat(full("B"), waiting_for_room("b", "B", 47)))
    gm.on_heartbeat(beat(full("C"), c))
    plan = gm.plan()
    assert plan.holds == (HoldOrder("b", "B", frozenset({"a", "c"})),)
    gm.instance_lost("B")  # b is recomputed wherever it goes next: nothing holds it
    assert gm.holds == {}
    clock.now += 2.0
    gm.on_heartbeat(beat(instance("A", 48, 0, batch=0, context=0)))
    gm.on_heartbeat(beat(full("C"), c))
    plan = gm.plan()
    assert plan.holds == () and plan.releases == ()
    # Those a hold yielded to were on a lost instance: it is released.
    gm.holds["x"] = HoldOrder("x", "A", frozenset({"gone"}))
    clock.now += 2.0
    gm.on_heartbeat(beat(instance("A", 48, 0, batch=0, context=0)))
    gm.on_heartbeat(beat(full("C"), c))
    assert gm.plan().releases == (ReleaseOrder("x", "A"),)
