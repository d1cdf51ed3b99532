"""The gManager: heartbeats in, plans out, on a clock moved by hand; and the whole loop of heartbeat, plan and
move protocol between rManagers, with the transport played by hand; the gManager beside the router (instance ids
and transport addresses, lost instances). Also the lending flags."""

from __future__ import annotations

import dataclasses

import pytest
from lending_cases import BLOCK, GPU_LIKE, instance, request, samples_of

from boundless.cluster.dispatcher import Dispatcher, MarkDead
from boundless.cluster.gmanager import GManager, InstanceLending
from boundless.cluster.lending_cluster import ClusterLending, OrderMove, PeerBack, PeerLost
from boundless.cluster.lending_plan import LendingThresholds, MoveOrder
from boundless.cluster.placement import Heartbeat, RequestPlacementEntry
from boundless.cluster.restarts import Restart, RestartPolicy
from boundless.cluster.rmanager import FreeLocalBlocks, LocalRequest, LocalState, RManager, SendBlocks, TryMove
from boundless.cluster.routing import Router
from boundless.config import ClusterConfig, ConfigError
from boundless.programs.process_table import ProcessTable

INTERVAL_S = 2.0
TIMEOUT_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def gmanager() -> tuple[GManager, Clock]:
    clock = Clock()
    return GManager(LendingThresholds(), INTERVAL_S, TIMEOUT_S, clock), clock


def debtor_beat(samples: bool = True) -> Heartbeat:
    report = instance("A", 64, 63, batch=1, context=1000, waiting=[4] * 6)
    return Heartbeat(report, (request("a-long", "A", 63, 1000),), tuple(samples_of(GPU_LIKE)) if samples else ())


def creditor_beat() -> Heartbeat:
    return Heartbeat(instance("B", 64, 12, batch=3, context=180), (request("b1", "B", 4, 60),))


def test_nothing_is_planned_until_the_engines_step_times_fit_the_model() -> None:
    gm, clock = gmanager()
    gm.on_heartbeat(debtor_beat(samples=False))
    gm.on_heartbeat(creditor_beat())
    assert gm.model() is None and gm.plan().moves == ()
    clock.now += INTERVAL_S
    gm.on_heartbeat(debtor_beat(samples=True))
    gm.on_heartbeat(creditor_beat())
    assert gm.model().base_s == pytest.approx(GPU_LIKE.base_s, rel=1e-6)
    assert gm.plan().moves == (MoveOrder("a-long", "A", "B", 23),)
    assert (gm.counters.plans, gm.counters.moves_ordered, gm.counters.blocks_ordered) == (1, 1, 23)


def test_a_plan_is_due_once_the_interval_has_passed() -> None:
    gm, clock = gmanager()
    assert not gm.due()  # nobody has reported
    gm.on_heartbeat(debtor_beat())
    gm.on_heartbeat(creditor_beat())
    assert gm.due()
    gm.plan()
    clock.now += INTERVAL_S / 2
    gm.on_heartbeat(debtor_beat(samples=False))
    gm.on_heartbeat(creditor_beat())
    assert not gm.due()  # too soon
    clock.now += INTERVAL_S / 2
    assert gm.due()


def test_a_plan_waits_for_an_instance_that_has_not_reported_since_the_last_one() -> None:
    gm, clock = gmanager()
    gm.on_heartbeat(debtor_beat())
    gm.on_heartbeat(creditor_beat())
    gm.plan()
    clock.now += INTERVAL_S
    gm.on_heartbeat(debtor_beat(samples=False))
    assert not gm.due()  # B's last report predates the plan: the moves ordered are not in it yet
    gm.on_heartbeat(creditor_beat())
    assert gm.due()


def test_a_silent_instance_takes_no_part_and_a_lost_one_is_forgotten() -> None:
    gm, clock = gmanager()
    gm.on_heartbeat(creditor_beat())
    clock.now += TIMEOUT_S + 1  # B falls silent
    gm.on_heartbeat(debtor_beat())
    assert [hb.instance_id for hb in gm.live()] == ["A"]
    assert gm.due()  # every live instance has reported
    assert gm.plan().moves == ()  # no creditor is live
    gm.on_heartbeat(creditor_beat())  # B is back
    clock.now += INTERVAL_S
    gm.on_heartbeat(debtor_beat(samples=False))
    assert gm.plan().moves == (MoveOrder("a-long", "A", "B", 23),)
    gm.instance_lost("B")
    assert "B" not in gm.lending() and [hb.instance_id for hb in gm.live()] == ["A"]


def run_protocol(orders: tuple[MoveOrder, ...], managers: dict[str, RManager], next_block_id: list[int]) -> None:
    """The transport: carry each order through try, send and confirm, freeing the debtor's copies."""
    for order in orders:
        debtor, creditor = managers[order.debtor], managers[order.creditor]
        [try_move] = debtor.move_kvcache(order.request_id, order.num_blocks, order.creditor)
        assert isinstance(try_move, TryMove)
        ok = creditor.try_move_kvcache(try_move.move_id, try_move.request_id, try_move.debtor, try_move.num_blocks)
        [send] = debtor.try_answered(try_move.move_id, creditor.instance_id, ok)
        assert isinstance(send, SendBlocks)
        ids = list(range(next_block_id[0], next_block_id[0] + send.num_blocks))
        next_block_id[0] += send.num_blocks
        [free] = debtor.move_done(send.move_id, creditor.instance_id, creditor.receive_blocks(send.move_id, ids))
        assert isinstance(free, FreeLocalBlocks)


def test_heartbeats_plans_and_moves_close_the_loop() -> None:
    clock = Clock()
    config = ClusterConfig(instances=2, kv_lending="on", lending_interval_s=INTERVAL_S)
    gm = GManager.from_config(config, clock)
    a = RManager("A", 64, BLOCK, clock, config.lending_reservation_timeout_s)
    b = RManager("B", 64, BLOCK, clock, config.lending_reservation_timeout_s, headroom_blocks=6)
    managers = {"A": a, "B": b}
    a.observe(LocalState(63, 1, 16, {"a-long": LocalRequest(1000, 63)}, waiting_blocks=(4,) * 6))
    b.observe(LocalState(12, 3, 16, {f"b{i}": LocalRequest(60, 4) for i in range(3)}))
    gm.on_heartbeat(a.heartbeat(samples_of(GPU_LIKE)))
    gm.on_heartbeat(b.heartbeat())
    plan = gm.plan()
    assert plan.moves == (MoveOrder("a-long", "A", "B", 23),)
    run_protocol(plan.moves, managers, [200])
    # A's engine frees the moved copies and admits its six waiting requests into the room.
    short = {f"a{i}": LocalRequest(60, 4) for i in range(6)}
    a.observe(LocalState(40 + 24, 7, 16, {"a-long": LocalRequest(1000, 40), **short}))
    clock.now += INTERVAL_S
    gm.on_heartbeat(a.heartbeat())
    gm.on_heartbeat(b.heartbeat())
    assert gm.lending() == {
        "A": InstanceLending(lent=0, reserved=0, borrowed=23, free=0, total=64),
        "B": InstanceLending(lent=23, reserved=0, borrowed=0, free=64 - 12 - 23, total=64),
    }
    assert gm.placement()["a-long"] == [
        RequestPlacementEntry("a-long", "A", 40, True),
        RequestPlacementEntry("a-long", "B", 23, False),
    ]
    assert gm.due() and gm.plan().moves == ()  # A's queue is in: nothing left to gain
    # The request ends: B frees what it held.
    releases = a.request_finished("a-long")
    freed = [action for r in releases for action in b.release(r.move_id)]
    assert [f.block_ids for f in freed] == [tuple(range(200, 223))] and b.lent_blocks == 0


def test_lending_flags_are_typed_and_checked() -> None:
    config = ClusterConfig()
    assert config.kv_lending == "off" and config.lending_interval_s >= config.heartbeat_interval_s
    bad = [
        {"kv_lending": "yes", "instances": 2},
        {"kv_lending": "on"},  # one instance: nobody to lend
        {"kv_lending": "on", "instances": 2, "decode_instances": 2},  # not with roles
        {"lending_interval_s": 0.1},  # under the heartbeat interval
        {"lending_debtor_max_batch": 0},
        {"lending_creditor_max_usage": 1.5},
        {"lending_creditor_headroom": 1.0},
        {"lending_min_gain": -0.1},
        {"lending_reservation_timeout_s": 0},
    ]
    for values in bad:
        with pytest.raises(ConfigError) as err:
            dataclasses.replace(config, **values)
        flag = "--" + next(iter(values)).replace("_", "-")
        assert flag in str(err.value) or "--kv-lending" in str(err.value)


# -- the gManager beside the router: instance ids and transport addresses --------------------------------------


def cluster_lending() -> tuple[ClusterLending, Clock]:
    gm, clock = gmanager()
    return ClusterLending(gm, {"0": "A", "1": "B", "2": "C"}), clock


def test_orders_go_to_the_debtors_instance_and_name_the_creditors_address() -> None:
    lending, _ = cluster_lending()
    assert lending.orders() == []  # nobody reported
    lending.on_heartbeat(debtor_beat())
    lending.on_heartbeat(creditor_beat())
    assert lending.orders() == [OrderMove("0", "a-long", 23, "B")]
    assert lending.orders() == []  # not due again before the interval and fresh heartbeats
    assert lending.lending()["0"] == InstanceLending(0, 0, 0, 1, 64)


def test_a_lost_instance_is_forgotten_and_every_live_one_told() -> None:
    lending, _ = cluster_lending()
    lending.on_heartbeat(debtor_beat())
    lending.on_heartbeat(creditor_beat())
    assert lending.instance_lost("1") == [PeerLost("0", "B"), PeerLost("2", "B")]
    assert lending.instance_lost("1") == []  # told once
    lending.on_heartbeat(creditor_beat())  # a late heartbeat of the lost instance is ignored
    assert set(lending.lending()) == {"0"} and lending.orders() == []  # no creditor left


def test_the_dispatcher_tells_the_rmanagers_when_an_instance_is_lost() -> None:
    lending, _ = cluster_lending()
    router = Router("locality", locality_threshold=4, max_imbalance=4)
    d = Dispatcher(["0", "1", "2"], router, ProcessTable(ttl_s=60), lambda: 0.0, lending)
    decisions = d.instance_lost("2", "gone")
    assert decisions == [MarkDead("2", "gone"), PeerLost("0", "C"), PeerLost("1", "C")]


def test_a_lost_instance_started_again_is_heard_again_and_every_live_one_told() -> None:
    lending, _ = cluster_lending()
    assert lending.instance_back("1") == []  # not lost: no news
    lending.instance_lost("1")
    lending.instance_lost("2")  # still down when "1" comes back: not told
    assert lending.instance_back("1") == [PeerBack("0", "1", "B")]
    assert lending.instance_back("1") == []  # told once
    lending.on_heartbeat(debtor_beat())
    lending.on_heartbeat(creditor_beat())  # the restarted instance's first heartbeat reaches the gManager
    assert lending.orders() == [OrderMove("0", "a-long", 23, "B")]
    assert lending.live_addresses() == {"0": "A", "1": "B"}


def test_an_instance_started_again_at_a_new_address_is_known_by_it() -> None:
    lending, _ = cluster_lending()
    lending.instance_lost("0")
    assert lending.instance_back("0", "A2") == [PeerBack("1", "0", "A2"), PeerBack("2", "0", "A2")]
    assert lending.addresses["0"] == "A2" and lending.instance_of == {"A2": "0", "B": "1", "C": "2"}


def test_the_dispatcher_tells_the_rmanagers_when_a_lost_instance_is_back() -> None:
    lending, _ = cluster_lending()
    router = Router("locality", locality_threshold=4, max_imbalance=4)
    clock = [0.0]
    d = Dispatcher(["0", "1", "2"], router, ProcessTable(ttl_s=60), lambda: clock[0], lending, RestartPolicy(1.0, 3))
    d.instance_lost("2", "gone")
    clock[0] = 1.0
    assert d.restarts_due() == [Restart("2", 1)]
    assert d.instance_ready("2", "C") == [PeerBack("0", "2", "C"), PeerBack("1", "2", "C")]
    assert d.views["2"].alive and lending.lost == set()
