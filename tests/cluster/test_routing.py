"""The router's decisions, pure: locality for long calls, load for short ones, never a dead instance."""

from __future__ import annotations

import random

import pytest

from boundless.cluster.dispatcher import AddResult, Dispatcher, Send
from boundless.cluster.routing import InstanceView, LoadIndex, NoLiveInstanceError, Router
from boundless.engine.core import RequestDelta
from boundless.engine.request import ProgramRef
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.process_table import ProcessTable


def views(*loads: int, dead: tuple[str, ...] = ()) -> list[InstanceView]:
    return [InstanceView(str(i), alive=str(i) not in dead, inflight=n) for i, n in enumerate(loads)]


def test_long_calls_stay_with_their_program_short_ones_balance() -> None:
    router = Router("locality", locality_threshold=100, max_imbalance=4)
    home = router.choose(views(0, 0), "p", 500)
    other = "1" if home == "0" else "0"
    # A busier home still gets the program's long calls while the imbalance is tolerable.
    busy = views(3, 0) if home == "0" else views(0, 3)
    assert router.choose(busy, "p", 600) == home
    assert router.choose(busy, "q", 600) == other  # a new program starts on the least loaded
    # A short call of the program goes to the least-loaded instance, and its KV now lives there.
    assert router.choose(busy, "p", 50) == other
    assert router.homes["p"] == other
    assert router.choose(views(1, 1), "p", 700) == other


def test_a_short_call_goes_home_while_home_is_among_the_least_loaded() -> None:
    """Short calls balance load; among equally loaded instances the program's home wins, since its conversation is
    cached there (rotating would recompute it elsewhere at no gain in balance)."""
    router = Router("locality", locality_threshold=100, max_imbalance=4)
    home = router.choose(views(0, 0, 0), "p", 50)
    assert [router.choose(views(0, 0, 0), "p", 50) for _ in range(6)] == [home] * 6
    # Programs without a home still rotate among the idle instances.
    assert {router.choose(views(0, 0, 0), f"q{i}", 50) for i in range(6)} == {"0", "1", "2"}
    tied = [InstanceView(str(i), inflight=2) for i in range(3)]
    assert router.choose(tied, "p", 50) == home
    # One call more at home: the short call goes to a least-loaded instance, which becomes its home.
    busier = [InstanceView(str(i), inflight=1 if str(i) == home else 0) for i in range(3)]
    assert router.choose(busier, "p", 500) == home  # a long call tolerates the imbalance
    moved = router.choose(busier, "p", 50)
    assert moved != home and router.homes["p"] == moved


def test_a_long_call_leaves_an_overloaded_home() -> None:
    router = Router("locality", locality_threshold=100, max_imbalance=4)
    home = router.choose(views(0, 0), "p", 500)
    other = "1" if home == "0" else "0"
    overloaded = views(5, 0) if home == "0" else views(0, 5)
    assert router.choose(overloaded, "p", 600) == other
    assert router.homes["p"] == other


def test_homes_of_dropped_programs_are_forgotten() -> None:
    router = Router("locality", locality_threshold=100)
    for pid in ("a", "b", "c"):
        router.choose(views(0, 0), pid, 500)
    router.forget(["a", "b", "c"], {"b"})  # dropped, and "b" back in the table since
    assert set(router.homes) == {"b"}


def test_a_dead_home_is_replaced() -> None:
    router = Router("locality", locality_threshold=100)
    home = router.choose(views(0, 0), "p", 500)
    other = "1" if home == "0" else "0"
    assert router.choose(views(0, 0, dead=(home,)), "p", 500) == other
    assert router.homes["p"] == other


def test_least_loaded_rotates_among_equals_and_skips_the_dead() -> None:
    router = Router("least-loaded")
    assert {router.choose(views(0, 0), None, 10) for _ in range(4)} == {"0", "1"}
    assert router.choose(views(3, 1), None, 10) == "1"
    assert {router.choose(views(0, 0, 0, dead=("1",)), None, 10) for _ in range(6)} == {"0", "2"}
    with pytest.raises(NoLiveInstanceError):
        router.choose(views(0, dead=("0",)), None, 10)


def test_round_robin_cycles() -> None:
    router = Router("round-robin")
    assert [router.choose(views(9, 0, 0), "p", 5000) for _ in range(6)] == ["0", "1", "2", "0", "1", "2"]


def least_loaded_by_scan(router: Router, views: list[InstanceView], program_id: str, num_tokens: int) -> str:
    """The locality router's choice by a plain pass over the views, as it was made before the load index."""
    live = [v for v in views if v.alive]
    lowest = min(v.load for v in live)
    ties = [v for v in live if v.load == lowest]
    least = ties[router._next % len(ties)]
    home = next((v for v in live if v.instance_id == router.homes.get(program_id)), None)
    if home is not None and (
        home.load == least.load
        or (num_tokens > router.locality_threshold and home.load - least.load <= router.max_imbalance)
    ):
        return home.instance_id
    return least.instance_id


def test_the_dispatchers_load_index_gives_the_choices_of_a_pass_over_the_views() -> None:
    """Loads going up and down, instances lost, calls aborted: every routed call goes where a pass over the views
    would have sent it (the index is refiled on every change, or a call would go to a stale least loaded)."""
    rng = random.Random(7)
    router = Router("locality", locality_threshold=50, max_imbalance=2)
    d = Dispatcher([str(i) for i in range(9)], router, ProcessTable(ttl_s=60.0), lambda: 0.0)
    running: list[str] = []
    routed = 0
    for n in range(600):
        op = rng.random()
        if op < 0.5 or not running:
            program, tokens = f"p{rng.randrange(12)}", rng.choice([10, 100])
            views = list(d.views.values())
            if any(v.alive for v in views):
                expected = least_loaded_by_scan(router, views, program, tokens)
                (send,) = d.submit(f"c{n}", [1] * tokens, SamplingParams(max_tokens=4), ProgramRef(program))
                assert isinstance(send, Send) and send.instance_id == expected
                routed += 1
                if not d.add_done(send, AddResult("ok")):
                    running.append(send.request_id)
        elif op < 0.85:
            rid = running.pop(rng.randrange(len(running)))
            call = d.inflight.get(rid)
            if call is not None:
                d.on_delta(call.instance, RequestDelta(rid, [1], "", [], True, "length"))
        elif op < 0.97:
            d.abort(running.pop(rng.randrange(len(running))))
        else:
            d.instance_lost(str(rng.randrange(9)), "test")
    fresh = LoadIndex(d.views.values())
    assert fresh.least_loaded() == d.load_index.least_loaded() and fresh.num_live == d.load_index.num_live
    assert routed > 250 and sum(not v.alive for v in d.views.values()) >= 1
