"""The cluster's decisions without Ray or threads: routing, accounting, failover, telling a call that failed on its
instance from an instance that is gone, and starting a lost instance again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from boundless.cluster.dispatcher import AbortOn, AddResult, Decision, Dispatcher, Fail, MarkDead, Send
from boundless.cluster.restarts import Restart, RestartPolicy
from boundless.cluster.routing import Router
from boundless.engine.core import RequestDelta, Resume
from boundless.engine.errors import InvalidRequestError
from boundless.engine.request import ProgramRef
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.process_table import ProcessTable

PARAMS = SamplingParams(max_tokens=8)
OK = AddResult("ok")


class Clock:
    """The dispatcher's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def dispatcher(n: int = 2, ttl_s: float = 60.0, restarts: RestartPolicy | None = None) -> tuple[Dispatcher, Clock]:
    clock = Clock()
    router = Router("locality", locality_threshold=4, max_imbalance=4)
    return Dispatcher([str(i) for i in range(n)], router, ProcessTable(ttl_s=ttl_s), clock, restarts=restarts), clock


def only_send(decisions: list[Decision]) -> Send:
    assert len(decisions) == 1 and isinstance(decisions[0], Send), decisions
    return decisions[0]


def placed(d: Dispatcher, request_id: str, prompt: list[int], program: ProgramRef | None = None) -> Send:
    """Submit a call and let the chosen instance take it."""
    send = only_send(d.submit(request_id, prompt, PARAMS, program))
    assert d.add_done(send, OK) == []
    return send


def delta(request_id: str, tokens: list[int], text: str, finished: bool = False, **kw) -> RequestDelta:
    return RequestDelta(request_id, tokens, text, [], finished, "length" if finished else None, **kw)


def test_a_call_goes_to_the_least_loaded_instance_and_its_finish_is_accounted() -> None:
    d, clock = dispatcher()
    first = placed(d, "a", [1, 2, 3])
    second = placed(d, "b", [4, 5, 6])
    assert {first.instance_id, second.instance_id} == {"0", "1"}
    assert first.resume is None and first.prompt == [1, 2, 3]
    program = ProgramRef("p")
    call = placed(d, "c", [7, 8, 9], program)
    assert d.views[call.instance_id].inflight == 2
    assert d.table.get("p").active_calls == 1
    clock.now = 105.0
    # The call waited 1 s of its 3 s on the instance's clock: 2 s of service.
    done = delta("c", [10], "x", finished=True, arrival_time=50.0, finish_time=53.0, service_s=2.0)
    assert d.on_delta(call.instance_id, done)
    record = d.table.get("p")
    assert (record.active_calls, record.completed_calls, record.service_s, record.waiting_s) == (0, 1, 2.0, 1.0)
    assert record.last_completion == 105.0  # the dispatcher's clock, not the instance's
    assert d.views[call.instance_id].inflight == 1 and "c" not in d.inflight
    # The program's next call carries its global service to whichever instance takes it.
    nxt = only_send(d.submit("d", [1, 2, 3, 4, 5, 6], PARAMS, program))
    assert nxt.program is not None and nxt.program.service_s == 2.0 and nxt.program.waiting_s == 1.0


def test_a_lost_instance_is_marked_dead_and_its_calls_resume_elsewhere() -> None:
    d, _ = dispatcher(3)
    calls = [placed(d, rid, [1, 2, 3]) for rid in ("a", "b", "c")]
    victim = calls[0].instance_id
    assert d.on_delta(victim, delta("a", [11, 12], "hi"))
    decisions = d.instance_lost(victim, "drain failed")
    assert decisions[0] == MarkDead(victim, "drain failed")
    resend = only_send(decisions[1:])
    assert resend.instance_id != victim and resend.request_id == "a"
    assert resend.resume == Resume((11, 12), 2) and resend.prompt == [1, 2, 3]
    assert d.add_done(resend, OK) == []
    assert d.num_failovers == 1 and d.inflight["a"].failovers == 1
    # A stale delta from the dead instance is dropped; the new instance's deltas count.
    assert not d.on_delta(victim, delta("a", [13], "!"))
    assert d.on_delta(resend.instance_id, delta("a", [13], "!"))
    assert d.inflight["a"].output_token_ids == [11, 12, 13]
    # Losing it again is no news; new calls never go there.
    assert d.instance_lost(victim, "heartbeat failed") == []
    assert all(placed(d, f"n{i}", [1]).instance_id != victim for i in range(6))


def test_a_resumed_call_reports_the_prompt_tokens_cached_where_it_first_ran() -> None:
    """OpenAI's ``cached_tokens`` counts the prompt's tokens a cache served the call. Resumed on another instance, the
    call's prompt there is its prompt and its output so far, whose count that instance reports: every delta keeps the
    first instance's count, as one engine keeps its first admission's through preemptions (and the P/D dispatcher
    the prefill engine's)."""
    d, _ = dispatcher()
    first = placed(d, "a", list(range(1, 40)))
    shown, _ = d.receive(first.instance_id, delta("a", [50, 51], "hi", num_cached_tokens=16))
    assert shown is not None and shown.num_cached_tokens == 16
    resend = only_send(d.instance_lost(first.instance_id, "heartbeat failed")[1:])
    assert d.add_done(resend, OK) == []
    # The new instance found the prompt and both output tokens cached (a program's earlier call left them there).
    for tokens, finished in (([52], False), ([53], True)):
        shown, _ = d.receive(resend.instance_id, delta("a", tokens, "!", finished, num_cached_tokens=41))
        assert shown is not None and shown.num_cached_tokens == 16
    assert "a" not in d.inflight


def test_a_call_that_fails_on_its_instance_fails_alone() -> None:
    d, _ = dispatcher()
    program = ProgramRef("p")
    send = only_send(d.submit("poison", [1, 2, 3], PARAMS, program))
    decisions = d.add_done(send, AddResult("failed", "RuntimeError: boom"))
    assert decisions == [Fail("poison", "failed", "RuntimeError: boom")]
    assert all(v.alive and v.inflight == 0 for v in d.views.values())
    assert d.table.get("p").active_calls == 0 and d.num_failovers == 0
    assert {placed(d, f"n{i}", [1]).instance_id for i in range(4)} == {"0", "1"}  # both keep serving


def test_an_instance_that_does_not_answer_is_lost_and_the_call_tries_the_next() -> None:
    d, _ = dispatcher()
    running = placed(d, "running", [1, 2, 3])
    program = ProgramRef("p")
    send = only_send(d.submit("new", [4, 5, 6], PARAMS, program))
    assert send.instance_id != running.instance_id  # the least loaded
    decisions = d.add_done(send, AddResult("unreachable", "ActorDiedError"))
    assert decisions[0] == MarkDead(send.instance_id, "add failed: ActorDiedError")
    retry = only_send(decisions[1:])
    assert retry.instance_id == running.instance_id and retry.resume is None
    # The last instance goes too: its running call and the new one have nowhere left to go.
    decisions = d.add_done(retry, AddResult("unreachable", "GetTimeoutError"))
    assert decisions == [
        MarkDead(running.instance_id, "add failed: GetTimeoutError"),
        Fail("running", "unavailable", "no live engine instance"),
        Fail("new", "unavailable", "no live engine instance"),
    ]
    assert not d.is_alive() and d.inflight == {} and d.pending == {}
    assert d.table.get("p").active_calls == 0


def test_invalid_and_busy_answers_fail_the_call_and_release_its_program() -> None:
    d, _ = dispatcher()
    program = ProgramRef("p")
    send = only_send(d.submit("too-long", [1] * 9, PARAMS, program))
    refusal = InvalidRequestError("too long", "prompt")
    assert d.add_done(send, AddResult("invalid", "too long", refusal)) == [
        Fail("too-long", "invalid", "too long", refusal)
    ]
    send = only_send(d.submit("later", [1], PARAMS, program))
    assert d.add_done(send, AddResult("busy", "queue full")) == [Fail("later", "busy", "queue full")]
    assert d.table.get("p").active_calls == 0
    assert all(v.alive and v.inflight == 0 for v in d.views.values())


def test_an_abort_reaches_the_instance_that_has_the_call() -> None:
    d, _ = dispatcher()
    program = ProgramRef("p")
    send = placed(d, "a", [1, 2, 3], program)
    assert d.abort("a") == [AbortOn(send.instance_id, "a")]
    assert d.views[send.instance_id].inflight == 0 and d.table.get("p").active_calls == 0
    assert d.abort("a") == []
    # Aborted while its add is under way: the instance that took it is told to drop it.
    send = only_send(d.submit("b", [1, 2, 3], PARAMS, program))
    assert d.abort("b") == []
    assert d.add_done(send, OK) == [AbortOn(send.instance_id, "b")]
    assert d.inflight == {} and d.table.get("p").active_calls == 0
    # Deltas of aborted calls are not delivered.
    assert not d.on_delta(send.instance_id, delta("b", [1], "x"))


def test_a_call_taken_by_an_instance_lost_meanwhile_goes_elsewhere() -> None:
    d, _ = dispatcher()
    send = only_send(d.submit("a", [1, 2, 3], PARAMS))
    assert d.instance_lost(send.instance_id, "heartbeat failed") == [MarkDead(send.instance_id, "heartbeat failed")]
    retry = only_send(d.add_done(send, OK))
    assert retry.instance_id != send.instance_id and d.num_failovers == 1


def test_idle_programs_expire_with_their_homes_on_the_dispatchers_clock() -> None:
    d, clock = dispatcher(ttl_s=60.0)
    for pid in ("old", "busy"):
        send = placed(d, pid, [1, 2, 3, 4, 5, 6], ProgramRef(pid))  # long: the program gets a home
        assert d.router.homes[pid] == send.instance_id
    d.on_delta(d.inflight["old"].instance, delta("old", [1], "x", finished=True, finish_time=1.0, service_s=0.5))
    clock.now += 59.0
    assert d.expire() == []
    clock.now += 1.0
    assert d.expire() == ["old"]  # "busy" still has a call in flight
    assert "old" not in d.table and "old" not in d.router.homes and "busy" in d.router.homes


def test_the_dispatcher_runs_without_ray() -> None:
    code = "import sys, boundless.cluster.dispatcher; assert 'ray' not in sys.modules, 'the dispatcher imports ray'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_lost_instance_is_restarted_after_the_delay_and_takes_calls_only_once_ready() -> None:
    d, clock = dispatcher(3, restarts=RestartPolicy(delay_s=5.0, max_restarts=3))
    calls = [placed(d, rid, [1, 2, 3, 4, 5, 6], ProgramRef(rid)) for rid in ("a", "b", "c")]
    victim = calls[0].instance_id
    d.instance_lost(victim, "drain failed")
    assert d.next_restart_at() == 105.0
    clock.now = 104.9
    assert d.restarts_due() == []
    clock.now = 105.0
    assert d.restarts_due() == [Restart(victim, 1)]
    assert d.restarts_due() == [] and d.next_restart_at() is None  # once
    # Starting: nothing is routed to it (the others take every call, however loaded).
    assert all(placed(d, f"s{i}", [1]).instance_id != victim for i in range(8))
    assert not d.views[victim].alive and d.restarts.state(victim) == "starting"
    # Its first heartbeat: it takes calls again, with no load (it holds none) and as nobody's home.
    assert d.instance_ready(victim) == []
    assert d.views[victim].alive and d.views[victim].inflight == 0
    assert d.load_index.live_view(victim) is not None
    assert victim not in d.router.homes.values()
    assert only_send(d.submit("after", [1], PARAMS)).instance_id == victim  # the least loaded by far
    assert d.restarts.counts(victim) == (1, 1, 0)
    assert d.instance_ready(victim) == []  # ready twice is no news


def test_restarts_back_off_and_stop_at_the_limit_failed_ones_included() -> None:
    d, clock = dispatcher(2, restarts=RestartPolicy(delay_s=2.0, max_restarts=3))
    due = []
    d.instance_lost("1", "gone")
    for outcome in ("ready", "failed", "ready"):
        assert d.next_restart_at() is not None
        due.append(d.next_restart_at() - clock.now)
        clock.now = d.next_restart_at()
        (restart,) = d.restarts_due()
        if outcome == "ready":
            d.instance_ready("1")
            assert d.views["1"].alive
            clock.now += 10.0
            assert d.instance_lost("1", "gone again")[0] == MarkDead("1", "gone again")
        else:  # it died before its first heartbeat: the restart failed, and is tried again later
            assert d.instance_lost("1", "restart failed: ActorDiedError") == [
                MarkDead("1", "restart failed: ActorDiedError")
            ]
            assert not d.views["1"].alive
    assert due == [2.0, 4.0, 8.0]  # twice as long each time
    assert restart == Restart("1", 3)
    assert d.next_restart_at() is None and d.restarts_due() == []  # the limit: no fourth restart
    assert d.restarts.state("1") == "retired" and d.restarts.counts("1") == (4, 2, 1)
    clock.now += 1000.0
    assert d.restarts_due() == [] and all(placed(d, f"n{i}", [1]).instance_id == "0" for i in range(4))


def test_with_every_instance_lost_calls_wait_for_a_restart_and_go_on_there() -> None:
    """No live instance, one being restarted: calls in flight (with their tokens) and new calls wait for it, an abort
    drops one, and all go to it once it is ready (they failed at once, in flight or new); when its restart fails with
    none left, those waiting fail as unavailable."""
    d, clock = dispatcher(1, restarts=RestartPolicy(delay_s=1.0, max_restarts=2))
    placed(d, "a", [1, 2, 3])
    d.receive("0", delta("a", [7, 8], "xy"))
    assert d.instance_lost("0", "killed") == [MarkDead("0", "killed")]  # "a" waits: no Fail
    assert d.submit("b", [4, 5], PARAMS) == [] and d.submit("c", [6], PARAMS) == []
    assert d.abort("c") == []
    clock.now += 1.0
    assert d.restarts_due() == [Restart("0", 1)]
    sends = d.instance_ready("0")
    assert [(x.request_id, x.resume.output_token_ids if x.resume else None) for x in sends] == [  # type: ignore[union-attr]
        ("a", (7, 8)),
        ("b", None),
    ]
    for send in sends:
        d.add_done(send, AddResult("ok"))  # type: ignore[arg-type]
    assert d.instance_lost("0", "killed again") == [MarkDead("0", "killed again")]  # both wait again
    clock.now += 2.0
    assert d.restarts_due() == [Restart("0", 2)]
    fails = d.instance_lost("0", "its restart failed")  # the last restart: nothing is coming
    assert sorted((x.request_id, x.reason) for x in fails if isinstance(x, Fail)) == [
        ("a", "unavailable"),
        ("b", "unavailable"),
    ]


def test_a_call_moved_onto_a_full_queue_waits_for_the_lost_instances_restart() -> None:
    """Its instance lost, a call moved to one whose queue is full waits for the restart (the room lost with it) and
    goes on there once it is ready; without a restart coming, it fails as busy, which the API answers with a 503 to
    retry (it was a 500, an engine error)."""
    d, clock = dispatcher(2, restarts=RestartPolicy(delay_s=1.0, max_restarts=1))
    first = placed(d, "a", [1, 2, 3])
    d.receive(first.instance_id, delta("a", [7], "x"))
    (mark, send) = d.instance_lost(first.instance_id, "killed")
    assert isinstance(mark, MarkDead) and isinstance(send, Send) and send.instance_id != first.instance_id
    assert d.add_done(send, AddResult("busy", "queue full")) == []  # it waits
    clock.now += 1.0
    assert d.restarts_due() == [Restart(first.instance_id, 1)]
    (again,) = d.instance_ready(first.instance_id)
    assert isinstance(again, Send) and again.request_id == "a" and again.resume == Resume((7,), 1)
    d2, _ = dispatcher(2)  # no restarts
    lost = placed(d2, "b", [1, 2, 3])
    (_, moved) = d2.instance_lost(lost.instance_id, "killed")
    assert d2.add_done(moved, AddResult("busy", "queue full")) == [Fail("b", "busy", "queue full")]  # type: ignore[arg-type]


def test_a_moved_call_that_finds_no_room_ends_as_a_503_to_retry() -> None:
    from boundless.api.server import failure_error
    from boundless.cluster.client import failure_delta

    for reason in ("busy", "unavailable"):
        end = failure_delta(Fail("a", reason, "queue full"))  # type: ignore[arg-type]
        error = failure_error([(end.finish_reason, end.stop_reason)])
        assert error is not None and error.status == 503 and error.headers == {"Retry-After": "5"}
    end = failure_delta(Fail("a", "failed", "RuntimeError: boom"))
    assert failure_error([(end.finish_reason, end.stop_reason)]).status == 500  # type: ignore[union-attr]


def test_without_restarts_a_lost_instance_stays_dead() -> None:
    for policy in (None, RestartPolicy(delay_s=0.0, max_restarts=0)):
        d, clock = dispatcher(2, restarts=policy)
        d.instance_lost("1", "gone")
        clock.now += 1e6
        assert d.restarts_due() == [] and d.next_restart_at() is None and d.instance_ready("1") == []
        assert not d.views["1"].alive and d.restarts.state("1") == "retired"


def test_an_instance_up_past_the_reset_starts_its_restarts_afresh() -> None:
    d, clock = dispatcher(2, restarts=RestartPolicy(delay_s=2.0, max_restarts=2, reset_after_s=600.0))

    def lose_and_restart() -> float:
        d.instance_lost("1", "gone")
        delay = d.next_restart_at() - clock.now
        clock.now = d.next_restart_at()
        assert len(d.restarts_due()) == 1
        d.instance_ready("1")
        return delay

    assert [lose_and_restart(), lose_and_restart()] == [2.0, 4.0]
    clock.now += 599.0  # up, but not long enough: the third loss is past the limit
    d.instance_lost("1", "gone")
    assert d.restarts.state("1") == "retired"

    d, clock = dispatcher(2, restarts=RestartPolicy(delay_s=2.0, max_restarts=2, reset_after_s=600.0))
    assert [lose_and_restart(), lose_and_restart()] == [2.0, 4.0]
    clock.now += 600.0  # up ten minutes: its restarts are forgotten
    assert [lose_and_restart(), lose_and_restart()] == [2.0, 4.0]
    assert d.restarts.counts("1") == (4, 4, 0)  # what /metrics counts is not reset
    d.instance_lost("1", "gone")  # lost at once after its last restart: the limit holds
    assert d.restarts.state("1") == "retired"

    d, clock = dispatcher(2, restarts=RestartPolicy(delay_s=2.0, max_restarts=1, reset_after_s=0.0))
    lose_and_restart()
    clock.now += 1e6  # 0: never reset
    d.instance_lost("1", "gone")
    assert d.restarts.state("1") == "retired"


def test_a_negative_restart_reset_is_a_flag_error() -> None:
    from boundless.config import ClusterConfig, ConfigError

    with pytest.raises(ConfigError, match="--restart-reset-s"):
        ClusterConfig(restart_reset_s=-1.0)
    assert RestartPolicy.from_config(ClusterConfig(restart_reset_s=0.0)).reset_after_s == 0.0
