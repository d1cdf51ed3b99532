"""The gManager's grants to requests longer than one pool (cluster/lending_grants.py), its room moves for requests
waiting for room (cluster/lending_plan.py), and which request the deadlock breaker holds back when some were held
before (cluster/lending_deadlock.py)."""

from __future__ import annotations

import dataclasses

import pytest
from lending_cases import ManualClock, instance, request
from lending_cases import heartbeat as beat

from boundless.cluster.gmanager import GManager
from boundless.cluster.lending_deadlock import find_deadlock
from boundless.cluster.lending_grants import plan_grants, ungrantable
from boundless.cluster.lending_plan import GrantOrder, LendingThresholds, MoveOrder, RefuseOrder, room_moves
from boundless.cluster.placement import InstanceReport, RequestReport
from boundless.config import ClusterConfig, ConfigError

THRESHOLDS = LendingThresholds()  # a creditor counts on lending 60% of its pool


def idle(iid: str, awaiting: tuple[tuple[str, int], ...] = (), total: int = 48) -> InstanceReport:
    return dataclasses.replace(instance(iid, total, 0, batch=0, context=0), awaiting_grant=awaiting)


def test_a_request_longer_than_its_pool_is_granted_with_a_creditor_taken_by_no_other_grant() -> None:
    # 70 blocks on a 48-block pool: 22 beyond it, one creditor (28.8 blocks) is enough.
    a, b = idle("A", (("a", 70),)), idle("B", (("b", 70),))
    (grant,) = plan_grants([a, b], [], THRESHOLDS, {"a": 1, "b": 2})
    assert grant == GrantOrder("a", "A", ("B",))  # the older first; B lends to it, so b waits
    assert plan_grants([a, b], [grant], THRESHOLDS, {"a": 1, "b": 2}) == ()
    # With two more instances, a borrows from one of them (B, which hosts a request awaiting a grant, lends last)
    # and b from the other.
    c, d = idle("C"), idle("D")
    grants = plan_grants([a, b, c, d], [], THRESHOLDS, {"a": 1, "b": 2})
    assert grants == (GrantOrder("a", "A", ("C",)), GrantOrder("b", "B", ("D",)))


def test_the_oldest_goes_first_and_a_newer_one_whose_instances_are_free_goes_ahead_of_a_blocked_one() -> None:
    a, b, c = idle("A", (("a", 70),)), idle("B", (("b", 70), ("b2", 70))), idle("C")
    grants = plan_grants([a, b, c], [], THRESHOLDS, {"b": 1, "a": 2, "b2": 3})
    # b (oldest) takes B and a creditor: C, since A hosts a request awaiting a grant. Then a takes A, but no creditor
    # is left for it; b2 shares b's instance.
    assert grants == (GrantOrder("b", "B", ("C",)),)
    in_force = [GrantOrder("x", "A", ("C",))]
    assert plan_grants([a, b, c], in_force, THRESHOLDS, {"b": 1, "a": 2, "b2": 3}) == ()  # no creditor left for b


def test_a_request_needing_more_than_one_creditor_takes_several_or_waits() -> None:
    # 100 blocks: 52 beyond the pool, two creditors of 28 each.
    hosts = [idle("A", (("a", 100),)), idle("B"), idle("C")]
    assert plan_grants(hosts, [], THRESHOLDS) == (GrantOrder("a", "A", ("B", "C")),)
    assert plan_grants(hosts[:2], [], THRESHOLDS) == ()  # one other instance cannot lend it enough: never granted
    # The server's longest context on three 48-block pools (2.2 pools, 105 blocks) is granted: 57 blocks beyond its
    # pool, on two creditors of 28.8 (rounded down to 28 each, it never would be).
    assert plan_grants([idle("A", (("a", 105),)), idle("B"), idle("C")], [], THRESHOLDS)[0].creditors == ("B", "C")
    # A creditor that keeps everything (headroom 99%) counts for nothing.
    stingy = LendingThresholds(creditor_headroom=0.99)
    assert plan_grants([idle("A", (("a", 50),)), idle("B")], [], stingy) == ()


def test_the_gmanager_grants_at_every_round_and_ends_a_grant_once_every_instance_reported_it_gone() -> None:
    clock = ManualClock()
    gm = GManager(THRESHOLDS, 2.0, 5.0, clock)
    gm.on_heartbeat(beat(idle("A", (("a", 70),))))
    gm.on_heartbeat(beat(idle("B", (("b", 70),))))
    assert gm.grant() == (GrantOrder("a", "A", ("B",)),) and gm.counters.grants_ordered == 1
    assert gm.grant() == ()  # no plan needs to be due: a round later, still in force
    # a runs (reported by A); b still waits.
    clock.now += 0.5
    running = dataclasses.replace(request("a", "A", 40), remote=(("B", 20),))
    gm.on_heartbeat(beat(instance("A", 48, 40, batch=1, context=960), running))
    gm.on_heartbeat(beat(idle("B", (("b", 70),))))
    assert gm.grant() == () and set(gm.grants) == {"a"}
    # a finished: A reported it gone, B not yet since the grant... both have now: b's turn.
    clock.now += 0.5
    gm.on_heartbeat(beat(idle("A")))
    gm.on_heartbeat(beat(idle("B", (("b", 70),))))
    assert gm.grant() == (GrantOrder("b", "B", ("A",)),) and set(gm.grants) == {"b"}
    # An instance lost takes its grants (its requests are recomputed elsewhere) and those it lent to.
    gm.instance_lost("A")
    assert gm.grants == {}


def test_a_request_no_live_instances_can_hold_is_refused_after_the_grant_timeout_unless_one_comes_back() -> None:
    # 100 blocks on 48-block pools: A and two creditors (28.8 each) hold it; A and one do not.
    assert ungrantable([idle("A", (("a", 100),)), idle("B"), idle("C")], THRESHOLDS) == []
    assert ungrantable([idle("A", (("a", 100),)), idle("B")], THRESHOLDS) == [("a", "A")]
    assert ungrantable([idle("A", (("a", 70),)), idle("B", (("b", 70),))], THRESHOLDS) == []  # one at a time
    clock = ManualClock()
    gm = GManager(THRESHOLDS, 2.0, 5.0, clock, grant_timeout_s=30.0)
    for report in (idle("A", (("a", 100),)), idle("B"), idle("C")):
        gm.on_heartbeat(beat(report))
    assert gm.grant() == (GrantOrder("a", "A", ("B", "C")),) and gm.refusals() == ()
    # C is lost before a starts: a waits for a grant no one can give.
    gm.instance_lost("C")
    clock.now = 1.0
    gm.on_heartbeat(beat(idle("A", (("a", 100),))))
    gm.on_heartbeat(beat(idle("B")))
    assert gm.grant() == () and gm.refusals() == ()
    clock.now = 20.0  # C back within the timeout: a is granted, nothing refused
    gm.on_heartbeat(beat(idle("A", (("a", 100),))))
    gm.on_heartbeat(beat(idle("B")))
    gm.on_heartbeat(beat(idle("C")))
    assert gm.grant() == (GrantOrder("a", "A", ("B", "C")),) and gm.refusals() == () and not gm.ungrantable_since
    # Lost again, for good: refused once the timeout has passed since it was first seen ungrantable, and only once.
    gm.instance_lost("C")
    for now in (21.0, 40.0, 50.9):
        clock.now = now
        gm.on_heartbeat(beat(idle("A", (("a", 100),))))
        gm.on_heartbeat(beat(idle("B")))
        assert gm.grant() == () and gm.refusals() == ()
    clock.now = 51.0
    gm.on_heartbeat(beat(idle("A", (("a", 100),))))
    gm.on_heartbeat(beat(idle("B")))
    assert gm.refusals() == (RefuseOrder("a", "A"),) and gm.counters.grants_refused == 1
    assert gm.refusals() == ()
    # The flag: the gManager of a cluster takes it; a timeout of nothing is a flag error.
    assert GManager.from_config(ClusterConfig(lending_grant_timeout_s=12.0), clock).grant_timeout_s == 12.0
    with pytest.raises(ConfigError, match="--lending-grant-timeout-s: must be positive"):
        ClusterConfig(lending_grant_timeout_s=0.0)


def waiting(rid: str, iid: str, blocks: int = 48) -> RequestReport:
    return dataclasses.replace(request(rid, iid, blocks), waits_for_room=True)


def test_a_request_waiting_for_room_is_lent_what_a_creditor_may_lend_without_a_model() -> None:
    full = instance("A", 48, 48, batch=0, context=768, waiting=[4])
    free, busy = instance("B", 48, 0, batch=0, context=0), instance("C", 48, 40, batch=2, context=640)
    # B may lend all but its headroom (5 of 48); C is above the usage threshold.
    assert room_moves([full, free, busy], [waiting("a", "A")], THRESHOLDS) == (MoveOrder("a", "A", "B", 43),)
    # Up to what the request may move (all but its last block), less what the plan already takes from B.
    small = dataclasses.replace(waiting("a", "A", 48), movable_blocks=10)
    assert room_moves([full, free], [small], THRESHOLDS) == (MoveOrder("a", "A", "B", 10),)
    planned = (MoveOrder("x", "C", "B", 40),)
    assert room_moves([full, free, busy], [waiting("a", "A")], THRESHOLDS, planned) == (MoveOrder("a", "A", "B", 3),)
    # A request the plan moved already, or none waiting: nothing more.
    assert room_moves([full, free], [waiting("a", "A")], THRESHOLDS, (MoveOrder("a", "A", "B", 5),)) == ()
    assert room_moves([full, free], [request("a", "A", 48)], THRESHOLDS) == ()


def test_the_gmanager_lends_to_a_request_waiting_for_room_before_its_model_is_fitted() -> None:
    # Seen with grants: the granted request filled its pool before the other instance had run a step, so no model
    # was fitted and no plan moved anything: it waited beside an idle pool for good.
    gm = GManager(THRESHOLDS, 2.0, 5.0, ManualClock())
    gm.on_heartbeat(beat(instance("A", 48, 48, batch=0, context=768, waiting=[4]), waiting("a", "A")))
    gm.on_heartbeat(beat(idle("B")))
    assert gm.model() is None
    assert gm.plan().moves == (MoveOrder("a", "A", "B", 43),)


def full(iid: str) -> InstanceReport:
    return instance(iid, 48, 48, batch=0, context=768, waiting=[4])


def test_the_breaker_holds_back_a_request_held_fewer_times_before_then_the_newest() -> None:
    a, b = waiting("a", "A"), waiting("b", "B")
    # Equal blocks: the newest is held, not the lower id.
    assert find_deadlock([full("A"), full("B")], [a, b], THRESHOLDS, True, {}, {"a": 1, "b": 2}).request_id == "b"
    assert find_deadlock([full("A"), full("B")], [a, b], THRESHOLDS, True, {}, {"a": 2, "b": 1}).request_id == "a"
    # Held before counts first: the older request held once before is not held again while a newer one waits.
    assert find_deadlock([full("A"), full("B")], [a, b], THRESHOLDS, True, {"b": 1}, {"a": 1, "b": 2}).request_id == "a"


def test_the_gmanager_remembers_a_held_request_across_its_hold() -> None:
    """No heartbeat names a held request, and a hold may outlast the heartbeat timeout after which the gManager
    forgets requests nobody reports: its count of holds must survive it, or once released it is the first held again
    (seen: one request held 8 times over)."""
    clock = ManualClock()
    gm = GManager(THRESHOLDS, 2.0, 5.0, clock)
    b = dataclasses.replace(waiting("b", "B"), remote=(("A", 10),))  # more blocks than a: a is held
    gm.on_heartbeat(beat(full("A"), waiting("a", "A")))
    gm.on_heartbeat(beat(full("B"), b))
    assert [h.request_id for h in gm.plan().holds] == ["a"]
    for _ in range(4):  # b runs on for 8 s; a, held, is reported by nobody
        clock.now += 2.0
        gm.on_heartbeat(beat(idle("A")))
        gm.on_heartbeat(beat(instance("B", 48, 48, batch=1, context=900), dataclasses.replace(b, waits_for_room=False)))
        gm.plan()
    clock.now += 2.0
    gm.on_heartbeat(beat(idle("A")))
    gm.on_heartbeat(beat(idle("B")))
    assert [r.request_id for r in gm.plan().releases] == ["a"] and gm.times_held == {"a": 1}
    # a comes back and fills its pool again; c, newer and with more blocks, does the same on B: c is held, not a.
    clock.now += 2.0
    c = dataclasses.replace(waiting("c", "B"), remote=(("A", 10),))
    gm.on_heartbeat(beat(full("A"), waiting("a", "A")))
    gm.on_heartbeat(beat(full("B"), c))
    assert [h.request_id for h in gm.plan().holds] == ["c"]
    # Requests nobody reports or holds for the heartbeat timeout are forgotten.
    for _ in range(4):
        clock.now += 2.0
        gm.on_heartbeat(beat(idle("A")))
        gm.on_heartbeat(beat(idle("B")))
        gm.plan()
    assert gm.times_held == {} and gm.arrival == {}
