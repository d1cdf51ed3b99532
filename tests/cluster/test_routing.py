"""The router's decisions, pure: locality for long calls, load for short ones, never a dead instance."""

from __future__ import annotations

import pytest

from boundless.cluster.routing import InstanceView, NoLiveInstanceError, Router


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
    router.retain({"b"})
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
