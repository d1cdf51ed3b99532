"""The program-aware policies and the process table, with a fake clock and no model."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from boundless.engine.request import Request
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.policies import ATLASPolicy, MLFQPolicy, PLASPolicy, QueueConfig
from boundless.programs.policy import FCFSPolicy
from boundless.programs.process_table import MAX_THREADS, ProcessTable
from boundless.programs.ref import ProgramRef

CFG = QueueConfig(num_queues=4, base_s=1.0, growth=4.0, beta=3.0)  # ranges [0,1) [1,4) [4,16) [16,inf)


def call(rid: str, program: str | None, t: float, thread: str | None = None, parents: tuple[str, ...] = ()) -> Request:
    ref = ProgramRef(program, thread, parents) if program else None
    return Request(rid, [1, 2, 3], SamplingParams(), arrival_time=t, program=ref)


def run_call(policy, request: Request, service: float, now: float) -> None:
    policy.on_arrival(request, request.arrival_time)
    policy.on_service(request, service, now)
    policy.on_finish(request, now)


def test_queue_config_ranges_and_quanta() -> None:
    assert CFG.boundaries == (1.0, 4.0, 16.0)
    assert CFG.quanta == (1.0, 3.0, 12.0, float("inf"))
    assert [CFG.queue_for(s) for s in (0.0, 0.99, 1.0, 5.0, 100.0)] == [0, 0, 1, 2, 3]


@pytest.mark.parametrize("cls", [PLASPolicy, ATLASPolicy])
def test_new_call_enters_the_queue_of_its_programs_service(cls) -> None:
    policy = cls(CFG)
    run_call(policy, call("a1", "long", 0.0), service=5.0, now=5.0)
    new_long = call("a2", "long", 6.0)
    new_short = call("b1", "short", 7.0)
    policy.on_arrival(new_long, 6.0)
    policy.on_arrival(new_short, 7.0)
    assert policy.calls["a2"].level == 2  # 5 s of service falls in [4, 16)
    assert policy.calls["b1"].level == 0
    # The short program's call is served first although it arrived later.
    assert sorted([new_long, new_short], key=lambda r: policy.priority(r, 7.0))[0] is new_short


def test_mlfq_starts_every_call_at_the_top() -> None:
    policy = MLFQPolicy(CFG)
    run_call(policy, call("a1", "long", 0.0), service=5.0, now=5.0)
    policy.on_arrival(call("a2", "long", 6.0), 6.0)
    assert policy.calls["a2"].level == 0


def test_demotion_when_the_quantum_is_used_up() -> None:
    policy = PLASPolicy(CFG)
    r = call("x", "p", 0.0)
    policy.on_arrival(r, 0.0)
    policy.on_service(r, 0.6, 0.6)
    assert policy.calls["x"].level == 0
    policy.on_service(r, 0.5, 1.1)  # 1.1 s >= Q1's 1 s quantum
    assert policy.calls["x"].level == 1 and policy.calls["x"].demotions == 1
    policy.on_service(r, 2.9, 4.0)  # 2.9 s < Q2's 3 s quantum
    assert policy.calls["x"].level == 1
    policy.on_service(r, 0.2, 4.2)
    assert policy.calls["x"].level == 2


def test_promotion_when_wait_over_service_reaches_beta() -> None:
    policy = PLASPolicy(CFG)
    run_call(policy, call("a1", "p", 0.0), service=5.0, now=5.0)  # program service 5 s, waited 0
    r = call("a2", "p", 10.0)
    policy.on_arrival(r, 10.0)
    assert policy.calls["a2"].level == 2
    policy.update(now=20.0)  # waited 10 s < 3 x 5 s
    assert policy.calls["a2"].level == 2
    policy.update(now=25.1)  # waited 15.1 s >= 3 x 5 s
    assert policy.calls["a2"].level == 0 and policy.calls["a2"].promotions == 1


def test_atlas_takes_the_critical_path_of_a_dag_and_plas_the_sum() -> None:
    def dag(policy) -> float:
        # Two threads in parallel (1 s and 3 s), then a join thread (2 s) whose parents are both.
        run_call(policy, call("t1", "p", 0.0, thread="t1"), 1.0, 1.0)
        run_call(policy, call("t2", "p", 0.0, thread="t2"), 3.0, 3.0)
        run_call(policy, call("t3", "p", 3.0, thread="t3", parents=("t1", "t2")), 2.0, 5.0)
        return policy.table.service("p")

    assert dag(ATLASPolicy(CFG)) == pytest.approx(5.0)  # max(1, 3) + 2
    assert dag(PLASPolicy(CFG)) == pytest.approx(6.0)  # 1 + 3 + 2


def test_atlas_equals_plas_for_a_single_thread() -> None:
    atlas, plas = ATLASPolicy(CFG), PLASPolicy(CFG)
    for policy in (atlas, plas):
        for i, s in enumerate((0.5, 1.5, 2.0)):
            run_call(policy, call(f"c{i}", "p", float(i * 10)), s, float(i * 10) + s)
    assert atlas.table.service("p") == pytest.approx(plas.table.service("p")) == pytest.approx(4.0)


def test_a_call_without_program_is_a_program_of_its_own() -> None:
    policy = PLASPolicy(CFG)
    run_call(policy, call("solo", None, 0.0), 2.0, 2.0)
    assert policy.table.service("solo") == pytest.approx(2.0)


def test_process_table_expires_idle_programs_and_stays_bounded() -> None:
    table = ProcessTable(ttl_s=10.0, max_programs=50)
    busy = ProgramRef("busy")
    table.call_arrived(busy, 0.0)  # active: never dropped
    for i in range(200):
        p = ProgramRef(f"p{i}")
        table.call_arrived(p, float(i))
        table.call_finished(p, 0.1, 0.0, float(i))
        assert len(table) <= 50
    assert "busy" in table
    assert table.expire(now=1000.0) and "busy" in table and len(table) == 1
    table.call_finished(busy, 1.0, 0.0, 1000.0)
    assert table.expire(now=1011.0) == ["busy"] and len(table) == 0


class _CountedRecords(OrderedDict):
    """A process table's records that count those an iteration passes over."""

    visited = 0

    def items(self):  # type: ignore[override]
        for item in super().items():
            self.visited += 1
            yield item


def test_an_arrival_at_the_size_cap_drops_the_least_recently_active_without_a_pass_over_every_program() -> None:
    # At the cap every new program makes room; a pass over every record each arrival stalled the engine's (or the
    # router's) thread for up to 100 ms at the default cap of 100,000 programs.
    table = ProcessTable(ttl_s=1e9, max_programs=1000)
    busy = ProgramRef("busy")
    table.call_arrived(busy, 0.0)  # active, least recently: passed over, never dropped
    for i in range(1000):
        table.call_arrived(ProgramRef(f"p{i}"), float(i))
        table.call_finished(ProgramRef(f"p{i}"), 0.1, 0.0, float(i))
    table._programs = records = _CountedRecords(table._programs)
    for i in range(1000, 1100):
        table.call_arrived(ProgramRef(f"p{i}"), float(i))
        table.call_finished(ProgramRef(f"p{i}"), 0.1, 0.0, float(i))
        assert len(table) == 1000
    assert "busy" in table
    assert not any(f"p{i}" in table for i in range(101)) and all(f"p{i}" in table for i in range(101, 1100))
    assert records.visited <= 100 * 4, f"{records.visited} records looked at for 100 arrivals"


def test_a_long_lived_program_keeps_its_most_recent_threads_only() -> None:
    # Before, a program naming a new thread per call held one record per call for as long as it lived.
    table = ProcessTable(ttl_s=1e9)
    program = "agent"
    table.call_arrived(ProgramRef(program, "planner"), 0.0)
    table.call_finished(ProgramRef(program, "planner"), 5.0, 0.0, 0.0)
    for i in range(3 * MAX_THREADS):
        table.call_arrived(ProgramRef(program, f"t{i}"), float(i))
        # Each worker joins the planner: its record, in use, is kept however many threads come after it.
        table.call_finished(ProgramRef(program, f"t{i}", ("planner",)), 1.0, 0.0, float(i))
        table.call_arrived(ProgramRef(program, "planner"), float(i))
        table.call_finished(ProgramRef(program, "planner"), 0.0, 0.0, float(i))
    threads = table.get(program).threads
    assert len(threads) == MAX_THREADS and "planner" in threads
    assert f"t{3 * MAX_THREADS - 1}" in threads and "t0" not in threads
    assert table.service(program) == 6.0  # the critical path through the planner, as before any was dropped


def test_the_policies_expiry_scans_at_most_once_per_hundredth_of_the_ttl() -> None:
    # Policies ask every engine step; a scan passes over every program, so it runs at most every ttl / 100.
    table = ProcessTable(ttl_s=100.0)
    for name, t in (("a", 0.0), ("b", 0.5)):
        table.call_arrived(ProgramRef(name), t)
        table.call_finished(ProgramRef(name), 0.1, 0.0, t)
    assert table.expire_due(now=100.0) == ["a"]  # idle for the TTL
    assert table.expire_due(now=100.6) == [] and "b" in table  # due, but within a scan interval of the last
    assert table.expire_due(now=101.0) == ["b"]  # dropped at most 1 s (ttl / 100) late


@pytest.mark.parametrize("monotonic", [True, False])
def test_expiry_drops_what_a_scan_of_every_program_drops(monotonic: bool) -> None:
    # The scan stops at the first program active within the TTL: it must drop what passing over all of them would,
    # with records made by a router's merge (never active here), the size cap, and a clock that goes back.
    rng = random.Random(7)
    table = ProcessTable(ttl_s=10.0, max_programs=40)
    now, expired = 0.0, 0
    for _ in range(4000):
        now += rng.expovariate(2.0) if monotonic or rng.random() < 0.9 else -rng.uniform(0.0, 5.0)
        pid, op = f"p{rng.randrange(60)}", rng.random()
        if op < 0.4:
            table.call_arrived(ProgramRef(pid), now)
        elif op < 0.7:
            table.call_finished(ProgramRef(pid), 0.1, 0.0, now)
        elif op < 0.8:
            table.call_abandoned(pid)
        elif op < 0.9:
            table.merge_remote(pid, 1.0, 0.5)
        else:
            records = table._programs.items()
            due = [p for p, rec in records if rec.active_calls == 0 and now - rec.last_activity >= table.ttl_s]
            assert table.expire(now) == due
            assert not any(p in table for p in due)
            expired += len(due)
    assert expired > 20  # (the cases drop programs)


@pytest.mark.parametrize("cls", [PLASPolicy, ATLASPolicy])
def test_a_program_back_after_its_ttl_starts_afresh_though_no_scan_dropped_it(cls) -> None:
    # An engine with nothing to do runs no scan: a program idle past the TTL was still in the table when its next call
    # came, and that call started in the queue of the program's old service (docs: programs idle past the TTL are
    # dropped), ahead of the programs that came after it in its queue by its old first arrival.
    config = QueueConfig(num_queues=4, base_s=1.0, growth=4.0, beta=3.0, ttl_s=10.0)
    policy = cls(config)
    run_call(policy, call("a1", "agent", 0.0), 5.0, 5.0)  # queue 2 ([4, 16))
    back = call("a2", "agent", 100.0)
    policy.on_arrival(back, 100.0)
    assert policy.calls["a2"].level == 0
    rec = policy.table.get("agent")
    assert (rec.service_s, rec.waiting_s, rec.completed_calls, rec.first_arrival) == (0.0, 0.0, 0, 100.0)
    # Behind a router, the view it sends with the call stands (its own table forgot the program too, or it ran
    # elsewhere meanwhile); this instance's stale history does not.
    policy.on_service(back, 20.0, 120.0)
    policy.on_finish(back, 120.0)
    policy.merge_remote_service(ProgramRef("agent", service_s=2.0, total_service_s=2.0, waiting_s=1.0))
    policy.on_arrival(call("a3", "agent", 300.0), 300.0)
    assert policy.calls["a3"].level == 1  # [1, 4): the router's 2 s, not this instance's 20 s
    assert (policy.table.get("agent").service_s, policy.table.get("agent").waiting_s) == (2.0, 1.0)
    # Within the TTL the views merge as before, never going back.
    policy.merge_remote_service(ProgramRef("agent", service_s=1.0, total_service_s=1.0, waiting_s=0.5))
    policy.on_arrival(call("a4", "agent", 305.0), 305.0)
    assert policy.calls["a4"].level == 1 and policy.table.get("agent").service_s == 2.0


def test_an_abandoned_call_does_not_keep_its_program_alive() -> None:
    table = ProcessTable(ttl_s=10.0, max_programs=50)
    p = ProgramRef("p")
    table.call_arrived(p, 0.0)
    table.call_arrived(p, 1.0)  # rejected or aborted: it will never finish
    table.call_finished(p, 0.5, 0.0, 2.0)
    assert not table.expire(now=100.0), "an abandoned call keeps counting as active"
    table.call_abandoned("p")
    assert table.expire(now=100.0) == ["p"]
    table.call_abandoned("p")  # unknown by now: nothing to do


def test_fcfs_orders_by_arrival() -> None:
    policy = FCFSPolicy()
    a, b = call("a", "x", 2.0), call("b", "y", 1.0)
    for r in (a, b):
        policy.on_arrival(r, r.arrival_time)
    assert sorted([a, b], key=lambda r: policy.priority(r, 3.0)) == [b, a]


@pytest.mark.parametrize("order_by_program", [False, True])
def test_order_within_a_queue_by_call_or_by_program(order_by_program) -> None:
    import dataclasses

    policy = PLASPolicy(dataclasses.replace(CFG, order_by_program=order_by_program))
    run_call(policy, call("a1", "old", 0.0), service=0.1, now=1.0)  # still in Q1 afterwards
    new_peer = call("b1", "new", 2.0)
    old_next = call("a2", "old", 3.0)
    policy.on_arrival(new_peer, 2.0)
    policy.on_arrival(old_next, 3.0)
    assert policy.calls["a2"].level == policy.calls["b1"].level == 0
    first = sorted([new_peer, old_next], key=lambda r: policy.priority(r, 3.0))[0]
    # By program: the older program's next call goes first, so its calls do not interleave with b's.
    assert first is (old_next if order_by_program else new_peer)


def test_atlas_starvation_compares_summed_wait_with_summed_service() -> None:
    policy = ATLASPolicy(CFG)  # beta 3
    for i in range(4):  # four parallel threads: 1 s of service and 2 s of waiting each
        run_call(policy, call(f"m{i}", "fan", 0.0, thread=f"t{i}"), service=1.0, now=3.0)
    rec = policy.table.get("fan")
    assert rec.service_s == 1.0 and rec.total_service_s == 4.0 and rec.waiting_s == 8.0
    policy.on_arrival(call("r", "fan", 3.0, thread="join", parents=("t0", "t1", "t2", "t3")), 3.0)
    assert policy.calls["r"].level == 1  # the critical path (1 s) sets its queue
    policy.update(3.0)
    # 8 s waited over 4 s served is under beta; against the 1 s critical path it would be 8 >= 3.
    assert policy.calls["r"].level == 1


def test_a_routers_global_view_keeps_order_and_starvation_consistent() -> None:
    """As an instance behind the router sees a program whose earlier calls ran elsewhere: the
    router's view is merged before the call arrives (engine/core.py)."""
    policy = ATLASPolicy(CFG)  # beta 3
    local = call("l1", "local", 100.0)
    policy.on_arrival(local, 100.0)
    policy.merge_remote_service(ProgramRef("routed", service_s=4.0, total_service_s=4.0, waiting_s=8.0))
    routed = call("r1", "routed", 500.0)
    policy.on_arrival(routed, 500.0)
    policy.on_service(routed, 0.1, 500.1)
    rec = policy.table.get("routed")
    # Its first arrival here is its call's, not a default of 0 that would put it ahead of everyone.
    assert rec.first_arrival == 500.0
    policy.calls["l1"].level = policy.calls["r1"].level = 2
    assert sorted([routed, local], key=lambda r: policy.priority(r, 500.1))[0] is local
    # 8 s waited over 4.1 s served (the router's sum plus this call's) is under beta: not starved.
    # Against this instance's local sum alone (0.1 s) it would be promoted at once.
    policy.update(500.1)
    assert policy.calls["r1"].level == 2
    # A router that sends no sum: the critical path stands in for it.
    table = ProcessTable()
    table.merge_remote("p", service_s=2.0, waiting_s=1.0)
    assert table.get("p").total_service_s == 2.0 and table.get("p").first_arrival is None


def test_only_a_routers_view_is_merged() -> None:
    policy = PLASPolicy(CFG)
    policy.merge_remote_service(ProgramRef("plain"))  # a call with no router behind it
    assert policy.table.get("plain") is None
    policy.merge_remote_service(ProgramRef("routed", service_s=5.0, waiting_s=1.0))
    assert policy.table.service("routed") == 5.0
    policy.merge_remote_service(ProgramRef("routed", service_s=2.0, waiting_s=0.5))  # an older view
    assert policy.table.service("routed") == 5.0 and policy.table.get("routed").waiting_s == 1.0
    FCFSPolicy().merge_remote_service(ProgramRef("routed", service_s=5.0))  # arrival order keeps no history
