"""Two requests over one pool on two real engines, each holding its pool and waiting for room only the other could
lend: the gManager's deadlock breaker holds one back, lends its blocks to the other, and releases it when the other
is done (cluster/lending_deadlock.py; engines over shared memory, the gManager beside them as the router holds it)."""

from __future__ import annotations

from lending_helpers import PARAMS, Recorded, reference

from boundless.cluster.gmanager import GManager
from boundless.cluster.lending_cluster import ClusterLending, OrderHold, OrderRelease
from boundless.cluster.lending_plan import LendingThresholds

POOL = 12  # blocks: 192 tokens
PROMPTS = {
    "a": [(13 * j) % 300 + 3 for j in range(200)],  # 13 blocks, and 12 tokens out: 14 blocks, two over the pool
    "b": [(17 * j) % 300 + 5 for j in range(200)],
}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_two_requests_waiting_for_each_other_s_room_are_served_by_holding_one_back(load, make_cluster) -> None:
    loaded = load("tiny-llama")
    want = reference(loaded, PROMPTS)
    clock = Clock()
    cluster = make_cluster(loaded, 2, clock, max_model_len=2 * POOL * 16, num_blocks=POOL)
    agents = {str(i): agent for i, agent in enumerate(cluster.agents)}
    lending = ClusterLending(
        GManager(LendingThresholds(), interval_s=1.0, heartbeat_timeout_s=10.0, clock=clock),
        {iid: agent.instance_id for iid, agent in agents.items()},
    )
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
            lending.on_heartbeat(agent.rm.heartbeat(agent.core.step_times.drain()))
        for order in lending.orders():
            orders.append(order)
            agent = agents[order.instance_id]
            assert agent.carry_out(order)
            if isinstance(order, OrderHold):
                # Its instance reports no waiting request: the planner lends the freed pool, keeping none for it.
                agent.observe()
                assert agent.rm.heartbeat().instance.waiting_blocks == ()
    assert not any(a.core.has_unfinished() for a in cluster.agents), "deadlocked"
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
