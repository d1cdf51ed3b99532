"""Two requests over one pool on two real engines (over shared memory, the gManager beside them as the router holds
it). Started at once, each holds its pool and waits for room only the other could lend: the gManager's deadlock
breaker holds one back, lends its blocks to the other, and releases it when the other is done
(cluster/lending_deadlock.py). With their peaks known the gManager's grants start them one at a time instead
(cluster/lending_grants.py)."""

from __future__ import annotations

from lending_helpers import PARAMS, Recorded, reference

from boundless.cluster.gmanager import GManager
from boundless.cluster.lending_cluster import ClusterLending, OrderGrant, OrderHold, OrderRefuse, OrderRelease
from boundless.cluster.lending_plan import LendingThresholds
from boundless.engine.core import GRANT_REFUSED

POOL = 12  # blocks: 192 tokens
PROMPTS = {
    "a": [(13 * j) % 300 + 3 for j in range(200)],  # 13 blocks, and 12 tokens out: 14 blocks, two over the pool
    "b": [(17 * j) % 300 + 5 for j in range(200)],
}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _serve_both(load, make_cluster, grants: bool) -> tuple[list, list[Recorded], object]:
    """Both requests, one on each engine, run to the end under the gManager's orders (carried out as the instances
    do, between steps); the orders given, what each engine sampled, and the cluster."""
    loaded = load("tiny-llama")
    clock = Clock()
    cluster = make_cluster(loaded, 2, clock, max_model_len=2 * POOL * 16, num_blocks=POOL)
    agents = {str(i): agent for i, agent in enumerate(cluster.agents)}
    lending = ClusterLending(
        GManager(LendingThresholds(), interval_s=1.0, heartbeat_timeout_s=10.0, clock=clock),
        {iid: agent.instance_id for iid, agent in agents.items()},
    )
    for agent in cluster.agents:
        agent.core.scheduler.grants_required = grants
    recs = [Recorded(), Recorded()]
    cluster.agents[0].core.add_request("a", PROMPTS["a"], PARAMS)
    cluster.agents[1].core.add_request("b", PROMPTS["b"], PARAMS)
    orders = []
    for _ in range(200):
        if not any(a.core.has_unfinished() for a in cluster.agents):
            break
        cluster.step_all(recs)
        clock.now += 1.0
        for agent in cluster.agents:  # each instance's heartbeat, as InstanceLending.heartbeat makes it
            agent.observe()
            agent.apply(agent.rm.expire())
            lending.on_heartbeat(agent.heartbeat())
        for order in lending.orders():
            orders.append(order)
            agent = agents[order.instance_id]
            assert agent.carry_out(order)
            if isinstance(order, OrderHold):
                # Its instance reports no waiting request: the planner lends the freed pool, keeping none for it.
                agent.observe()
                assert agent.rm.heartbeat().instance.waiting_blocks == ()
    assert not any(a.core.has_unfinished() for a in cluster.agents), "deadlocked"
    return orders, recs, cluster


def test_two_requests_waiting_for_each_other_s_room_are_served_by_holding_one_back(load, make_cluster) -> None:
    # As for requests whose peak the engines cannot know (no max_tokens): nothing asks for a grant.
    orders, recs, cluster = _serve_both(load, make_cluster, grants=False)
    want = reference(load("tiny-llama"), PROMPTS)
    # Both filled their pools and waited; one was held back (the breaker's), lent the other room, and came back.
    holds = [o for o in orders if isinstance(o, OrderHold)]
    assert len(holds) == 1 and [o for o in orders if isinstance(o, OrderRelease)] == [
        OrderRelease(holds[0].instance_id, holds[0].request_id)
    ]
    assert sum(a.stats.requests_held for a in cluster.agents) == 1
    assert sum(a.stats.moves_out for a in cluster.agents) >= 2  # each borrowed in its turn
    # Greedy output as one engine holding everything.
    assert recs[0].tokens["a"] == want.tokens["a"] and recs[1].tokens["b"] == want.tokens["b"]
    for agent in cluster.agents:
        assert agent.rm.lent_blocks == 0 and agent.core.kv.pool.num_used == 0


def test_two_requests_over_one_pool_start_one_at_a_time_on_grants_and_none_is_held(load, make_cluster) -> None:
    orders, recs, cluster = _serve_both(load, make_cluster, grants=True)
    want = reference(load("tiny-llama"), PROMPTS)
    # a came first: granted with b's engine as its creditor; b waited for a's grant to end (a done), holding nothing.
    grants = [o for o in orders if isinstance(o, OrderGrant)]
    assert [g.request_id for g in grants] == ["a", "b"] and not any(isinstance(o, OrderHold) for o in orders)
    assert sum(a.stats.requests_granted for a in cluster.agents) == 2
    assert sum(a.stats.requests_held for a in cluster.agents) == 0
    assert sum(a.stats.moves_out for a in cluster.agents) >= 2  # each borrowed in its turn
    assert recs[0].tokens["a"] == want.tokens["a"] and recs[1].tokens["b"] == want.tokens["b"]
    for agent in cluster.agents:
        assert agent.rm.lent_blocks == 0 and agent.core.kv.pool.num_used == 0


def test_a_request_over_its_pool_with_its_only_creditor_lost_fails_with_the_refusal_and_frees_its_engine(
    load, make_cluster
) -> None:
    loaded = load("tiny-llama")
    clock = Clock()
    cluster = make_cluster(loaded, 2, clock, max_model_len=2 * POOL * 16, num_blocks=POOL)
    agents = {str(i): agent for i, agent in enumerate(cluster.agents)}
    gm = GManager(LendingThresholds(), interval_s=1.0, heartbeat_timeout_s=10.0, clock=clock, grant_timeout_s=5.0)
    lending = ClusterLending(gm, {iid: agent.instance_id for iid, agent in agents.items()})
    host = cluster.agents[0]
    host.core.add_request("a", PROMPTS["a"], PARAMS)  # 14 blocks at its peak: two over its pool
    host.core.add_request("short", PROMPTS["b"][:40], PARAMS)  # fits: runs while "a" waits, and after
    lending.instance_lost("1")  # its only creditor, before any grant: "a" can never be granted
    refused, finished = [], {}
    for _ in range(20):
        finished |= {d.request_id: d.finish_reason for d in host.step() if d.finished}
        clock.now += 1.0
        host.observe()
        lending.on_heartbeat(host.heartbeat())
        for order in lending.orders():
            assert order == OrderRefuse("0", "a") and host.carry_out(order)
        refused += host.take_refused()
    (delta,) = refused
    assert (delta.request_id, delta.finished, delta.finish_reason, delta.stop_reason) == (
        "a",
        True,
        "error",
        GRANT_REFUSED,
    )
    assert "a" not in host.core.scheduler.requests and not host.core.has_unfinished()
    assert host.stats.requests_refused == 1 and gm.counters.grants_refused == 1
    assert finished == {"short": "length"}  # served beside it, and nothing else ended
    assert host.core.kv.pool.num_used == 0
