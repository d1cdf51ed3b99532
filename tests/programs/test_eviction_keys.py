"""Programs' eviction keys: a pure function of the process table, the policy's order and a clock."""

from __future__ import annotations

import math

from boundless.engine.request import Request
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.eviction import FINISHED
from boundless.programs.eviction import IDLE_GAPS, PolicyRanking, eviction_key, idle_limit_s
from boundless.programs.policies import PLASPolicy, QueueConfig
from boundless.programs.policy import FCFSPolicy
from boundless.programs.process_table import ProcessTable, ProgramRecord
from boundless.programs.ref import ProgramRef


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _call(rid: str, program: str, arrival: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=arrival, program=ProgramRef(program))


def test_the_key_of_a_finished_an_idle_and_an_active_program() -> None:
    assert eviction_key(None, (0.0,), now=5.0, idle_limit_s=10.0) == (FINISHED, math.inf)
    active = ProgramRecord("a", active_calls=1, last_arrival=1.0)
    assert eviction_key(active, (2.0, 7.0), now=100.0, idle_limit_s=10.0) == ((1.0, -2.0, -7.0), math.inf)
    idle = ProgramRecord("i", last_arrival=1.0, last_completion=3.0)
    assert eviction_key(idle, (0.0, 1.0), now=5.0, idle_limit_s=10.0) == ((1.0, -0.0, -1.0), 13.0)
    assert eviction_key(idle, (0.0, 1.0), now=13.0, idle_limit_s=10.0) == (FINISHED, math.inf)
    assert (1.0, -math.inf) > FINISHED  # below every program still alive


def test_a_program_idle_many_times_its_usual_gap_counts_as_finished() -> None:
    record = ProgramRecord("p", longest_gap_s=2.0)
    assert idle_limit_s(record, None, ttl_s=600.0) == 600.0  # no program came back yet: the TTL
    assert idle_limit_s(record, 1.0, ttl_s=600.0) == IDLE_GAPS * 2.0
    assert idle_limit_s(record, 3.0, ttl_s=600.0) == IDLE_GAPS * 3.0
    assert idle_limit_s(record, 1000.0, ttl_s=600.0) == 600.0


def test_the_table_measures_the_gaps_between_a_programs_calls() -> None:
    table = ProcessTable()
    p = ProgramRef("p")
    table.call_arrived(p, 0.0)
    table.call_finished(p, 0.1, 0.0, 1.0)
    table.call_arrived(p, 4.0)  # 3 s at a tool
    table.call_finished(p, 0.1, 0.0, 5.0)
    table.call_arrived(p, 6.0)
    rec = table.get("p")
    assert rec is not None and rec.longest_gap_s == 3.0
    assert table.typical_gap_s is not None and 1.0 < table.typical_gap_s < 3.0


def test_under_plas_the_programs_served_last_rank_lowest() -> None:
    clock = Clock()
    policy = PLASPolicy(QueueConfig(base_s=1.0, growth=2.0))
    ranking = PolicyRanking.of_policy(policy, clock)
    feed, other = ranking.subscribe(), ranking.subscribe()
    # "long" has received 5 s of service: its calls start in Q3; "early" and "late" start in Q1.
    long_call = _call("l0", "long", 0.0)
    policy.on_arrival(long_call, 0.0)
    policy.on_service(long_call, 5.0, 5.0)
    policy.on_finish(long_call, 5.0)
    for rid, program, t in (("l1", "long", 6.0), ("e", "early", 1.0), ("t", "late", 2.0)):
        policy.on_arrival(_call(rid, program, t), t)
    clock.now = 6.0
    assert feed() == {"long", "early", "late"} and other() == {"long", "early", "late"}
    keys = {p: ranking.eviction_key(p)[0] for p in ("long", "early", "late")}
    # Q1 before Q3; within Q1 by the program's first arrival (plas serves a queue by program).
    assert keys["long"] < keys["late"] < keys["early"]
    # "early" goes off to a tool: its next call starts in Q1, before "late": it stays above it, for a while.
    policy.on_finish(_call("e", "early", 1.0), 6.5)
    key, until = ranking.eviction_key("early")
    assert key > keys["late"] and until < math.inf
    clock.now = until
    assert ranking.eviction_key("early")[0] == FINISHED


def test_under_fcfs_idle_programs_rank_below_every_waiting_call() -> None:
    clock = Clock()
    policy = FCFSPolicy()
    ranking = PolicyRanking.of_policy(policy, clock)
    for rid, program, t in (("a", "first", 0.0), ("b", "second", 1.0), ("c", "idle", 0.5)):
        policy.on_arrival(_call(rid, program, t), t)
    policy.on_finish(_call("c", "idle", 0.5), 2.0)
    clock.now = 2.0
    keys = {p: ranking.eviction_key(p)[0] for p in ("first", "second", "idle")}
    # Its next call queues behind every call here; of those, the last to arrive is served last.
    assert keys["idle"] < keys["second"] < keys["first"]


def test_a_call_changing_queue_is_reported() -> None:
    policy = PLASPolicy(QueueConfig(base_s=1.0))
    ranking = PolicyRanking.of_policy(policy, Clock())
    feed = ranking.subscribe()
    call = _call("r", "p", 0.0)
    policy.on_arrival(call, 0.0)
    feed()
    policy.on_service(call, 0.5, 0.5)  # within its quantum
    assert feed() == set()
    policy.on_service(call, 0.6, 1.1)  # used it up: one queue down
    assert feed() == {"p"}
