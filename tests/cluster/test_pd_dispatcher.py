"""The prefill/decode dispatcher without Ray or threads: a call's four phases, the read path, and what
happens when an engine is lost in each phase (nothing lost or repeated for the client)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from boundless.cluster.client import DispatcherFrontEnd
from boundless.cluster.dispatcher import AbortOn, AddResult, Fail, MarkDead, Send
from boundless.cluster.pd_dispatcher import (
    MAX_STREAM_LOSSES,
    PREFETCH_HOST_SHARE,
    PROGRAM_ORDER_LEAD_S,
    Continue,
    DropPrefetch,
    PDCall,
    PDDecision,
    PDDispatcher,
    PDInstance,
    Prefetch,
    Prepare,
    PrepareResult,
)
from boundless.cluster.pd_scheduler import PDSchedulerConfig
from boundless.cluster.restarts import Restart, RestartPolicy
from boundless.engine.async_engine import StreamRegistry
from boundless.engine.core import KV_STREAM_LOST, RequestDelta, Resume
from boundless.engine.handoff import IntakeAnswer
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef

PARAMS = SamplingParams(max_tokens=8)
OK = AddResult("ok")
BLOCK = 16


def dispatcher(
    pes: int = 1, des: int = 1, kv_path: str = "dualpath", restarts: RestartPolicy | None = None, clock=lambda: 100.0
) -> PDDispatcher:
    instances = {f"p{i}": PDInstance("prefill", f"p{i}", f"addr-p{i}") for i in range(pes)}
    instances |= {f"d{i}": PDInstance("decode", f"d{i}", f"addr-d{i}") for i in range(des)}
    config = PDSchedulerConfig(alpha=64, beta=10_000, kv_path=kv_path)  # type: ignore[arg-type]
    return PDDispatcher(instances, ProcessTable(), clock, config, BLOCK, restarts=restarts)


def delta(rid: str, tokens: list[int], text: str, finish: str | None = None) -> RequestDelta:
    return RequestDelta(rid, tokens, text, [], finish is not None, finish, finish_time=1.0 if finish else None)


def prepared(d: PDDispatcher, rid: str, prompt: list[int], answer: IntakeAnswer, program=None) -> tuple[Prepare, Send]:
    """Submit a call, let its DE prepare and its PE take it."""
    (prepare,) = d.submit(rid, prompt, PARAMS, program)
    assert isinstance(prepare, Prepare)
    (send,) = d.prepare_done(prepare, PrepareResult("ok", answer))
    assert isinstance(send, Send) and send.handoff is not None
    assert d.add_done(send, OK) == []
    return prepare, send


def test_a_call_is_prepared_on_a_de_prefilled_on_a_pe_and_continued_on_the_de() -> None:
    d = dispatcher()
    prompt = list(range(40))
    prepare, send = prepared(d, "a", prompt, IntakeAnswer(send_from_block=1))
    assert prepare.instance_id == "d0" and prepare.plan.peer == "addr-p0" and prepare.plan.push_tag is None
    assert send.instance_id == "p0" and send.resume is None
    assert send.handoff.peer == "addr-d0" and send.handoff.send_tag == prepare.plan.recv_tag
    assert send.handoff.send_from_block == 1 and send.handoff.recv_blocks == 0
    loads = {load.engine_id: (load.seq, load.tok) for load in d.loads()}
    assert loads == {"p0": (1, 40), "d0": (1, 40)}
    # The PE's handoff delta goes to the client as an ordinary token; the DE gets the token to go on from.
    shown, follow = d.receive("p0", delta("a", [7], "x", "handoff"))
    assert shown is not None and not shown.finished and shown.new_token_ids == [7]
    (cont,) = follow
    assert isinstance(cont, Continue) and cont.instance_id == "d0"
    assert cont.resume.output_token_ids == (7,) and cont.resume.text_chars_sent == 1
    assert d.continue_done(cont, OK) == []
    assert d.receive("p0", delta("a", [8], "y"))[0] is None  # nothing more from the PE counts
    shown, _ = d.receive("d0", delta("a", [8, 9], "yz", "length"))
    assert shown is not None and shown.finished
    assert d.calls == {} and {(load.seq, load.tok) for load in d.loads()} == {(0, 0)}


def test_a_programs_next_call_reads_its_stored_prefix_where_the_links_finish_first() -> None:
    d = dispatcher()
    program = ProgramRef("agent")
    first = list(range(40))
    prepared(d, "t1", first, IntakeAnswer(0), program)
    d.receive("p0", delta("t1", [50], "a", "handoff"))
    d.receive("d0", delta("t1", list(range(51, 58)), "bcdefgh", "length"))
    # The next turn extends the last one: three full blocks of it are in the store, the PE's memory holds the first
    # two (the last prompt's), the DE's all three (it decoded the rest). The PE's node reads a lot.
    d.report("p0", 1000)
    d.report("d0", 0)
    (prepare,) = d.submit("t2", first + list(range(50, 58)) + list(range(60, 80)), PARAMS, program)
    assert isinstance(prepare, Prepare) and prepare.plan.push_tag is not None  # DE-read
    assert prepare.prefill_engine == "p0"  # asked first what it holds, so that the DE pushes only the rest
    answer = IntakeAnswer(send_from_block=3, push_blocks=1, push_from=2)  # the PE holds blocks 0 and 1
    (send,) = d.prepare_done(prepare, PrepareResult("ok", answer))
    assert send.handoff.recv_tag == prepare.plan.push_tag
    assert (send.handoff.recv_from, send.handoff.recv_blocks) == (2, 1)
    assert d.placements == {"de": 2} and d.placed_stored_tokens["de"] == 32 + 48  # the first call's tie: the DE
    # What the DE holds it pushes from memory: nothing joins its node's read queue (the stored estimate did, 48).
    assert (d.read_queues["p0"], d.read_queues["d0"]) == (1000, 0)
    assert d.add_done(send, OK) == []
    d.receive("p0", delta("t2", [90], "x", "handoff"))
    d.receive("d0", delta("t2", [91], "y", "length"))
    # A next turn the PE holds whole (the last prompt plus no new full block) reads on the PE, its long queue
    # notwithstanding: nothing to read on either path, and no push.
    (prepare,) = d.submit("t3", first + list(range(50, 58)) + list(range(60, 80)) + [90], PARAMS, program)
    assert prepare.plan.push_tag is None and d.placements == {"pe": 1, "de": 2}
    # Under basic the PE always reads, whatever the queues.
    b = dispatcher(kv_path="basic")
    b.report("p0", 1000)
    prepared(b, "t1", first, IntakeAnswer(0), program)
    b.receive("p0", delta("t1", [50], "a", "handoff"))
    b.receive("d0", delta("t1", [51], "b", "length"))
    (prepare,) = b.submit("t2", first + [50, 51] + list(range(60, 80)), PARAMS, program)
    assert prepare.plan.push_tag is None and b.placements == {"pe": 2}


def test_a_programs_first_call_counts_its_prompts_full_blocks_as_stored() -> None:
    # An agent resumed with its context in the store: its first call here can read on the DE's node. (A wrong
    # guess costs the engines a stat each: they count what the store holds before reading.)
    d = dispatcher()
    d.report("p0", 1000)
    d.report("d0", 0)
    (prepare,) = d.submit("t0", list(range(40)), PARAMS, ProgramRef("resumed"))
    assert isinstance(prepare, Prepare) and prepare.plan.push_tag is not None
    assert d.placements == {"de": 1} and d.placed_stored_tokens["de"] == 32
    # A call without a program still counts as nothing stored: no read path.
    (prepare,) = d.submit("plain", list(range(40)), PARAMS)
    assert prepare.plan.push_tag is None and d.placements["none"] == 1


def test_reads_placed_between_reports_count_in_their_nodes_queue() -> None:
    d = dispatcher(des=1)
    d.report("p0", 40)
    d.report("d0", 0)
    # Two agents resumed with 64 tokens of context each in the store, in neither engine's memory.
    (first,) = d.submit("a", list(range(64)) + [9], PARAMS, ProgramRef("a"))
    assert first.plan.push_tag is not None  # DE-read: the DE's node finishes the read first (0 + 64 < 40 + 64)
    # No report since: the 64 tokens placed on the DE's node make its queue the longer one now.
    (second,) = d.submit("b", list(range(64)) + [9], PARAMS, ProgramRef("b"))
    assert second.plan.push_tag is None
    assert d.placements == {"de": 1, "pe": 1}
    assert {load.engine_id: load.read_queue for load in d.loads()} == {"p0": 40 + 64, "d0": 64}
    d.report("d0", 0)  # a report replaces the estimate
    assert {load.engine_id: load.read_queue for load in d.loads()}["d0"] == 0


def test_a_decode_engine_takes_calls_only_while_its_kv_memory_has_room() -> None:
    instances = {"p0": PDInstance("prefill", "p0", "addr-p0"), "d0": PDInstance("decode", "d0", "addr-d0", 100)}
    d = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    prepared(d, "a", list(range(60)), IntakeAnswer(0))
    # a takes its 60 prompt tokens and room for its 8 output tokens, in whole 16-token blocks: 80 of the 100.
    assert {load.engine_id: load.kv_free_tokens for load in d.loads()} == {"p0": None, "d0": 20}
    assert d.submit("b", list(range(60)), PARAMS) == []  # 60 tokens do not fit in the 20 left: b waits
    assert [c.request_id for c in d.queue] == ["b"]
    d.receive("p0", delta("a", [7], "x", "handoff"))
    _, follow = d.receive("d0", delta("a", [8], "y", "length"))  # a ends: its tokens leave the DE
    (prepare,) = follow
    assert isinstance(prepare, Prepare) and prepare.request_id == "b" and prepare.instance_id == "d0"
    # A DE with no call has room for anything: a call longer than its memory is not stuck in the queue.
    e = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    (prepare,) = e.submit("long", list(range(150)), PARAMS)
    assert isinstance(prepare, Prepare) and prepare.instance_id == "d0"
    # One burst is accounted call by call: an empty DE takes the first of two calls that together overfill it.
    f = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    decisions = f.submit("x", list(range(60)), PARAMS) + f.submit("y", list(range(60)), PARAMS)
    assert [p.request_id for p in decisions] == ["x"] and [c.request_id for c in f.queue] == ["y"]


def test_a_prefill_engine_takes_calls_only_while_its_memory_holds_their_prompts_together() -> None:
    # Two DEs with room for every call, one PE whose memory holds 100 tokens: the DEs' room alone would put all three
    # 40-token calls on the PE at once, and the prefix one of them found in the PE's memory at its arrival would be
    # evicted by the others before its admission (and computed again).
    instances = {"p0": PDInstance("prefill", "p0", "addr-p0", 100)}
    instances |= {f"d{i}": PDInstance("decode", f"d{i}", f"addr-d{i}", 1000) for i in range(2)}
    d = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    decisions = [x for rid in "abc" for x in d.submit(rid, list(range(40)), PARAMS)]
    assert [p.request_id for p in decisions] == ["a", "b"] and [c.request_id for c in d.queue] == ["c"]
    # Each placed call takes its prompt in whole blocks (48 tokens) until its handoff.
    assert {load.engine_id: load.kv_free_tokens for load in d.loads()}["p0"] == 100 - 2 * 48
    (send,) = d.prepare_done(decisions[0], PrepareResult("ok", IntakeAnswer(0)))
    assert d.add_done(send, OK) == []
    # a's handoff frees its room on the PE (it decodes on its DE from there): c is placed now.
    _, follow = d.receive("p0", delta("a", [7], "x", "handoff"))
    assert [type(x) for x in follow] == [Continue, Prepare] and follow[1].request_id == "c"
    assert d.submit("late", list(range(40)), PARAMS) == []  # b and c fill the PE again: the next call waits
    assert [c.request_id for c in d.queue] == ["late"] and d.calls["c"].phase == "preparing"
    # A PE with no call has room for anything: a call longer than its memory still goes there.
    e = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    (prepare,) = e.submit("long", list(range(150)), PARAMS)
    assert isinstance(prepare, Prepare) and e.calls["long"].prefill_engine == "p0"


def reading_ahead(kv_path: str = "dualpath", des: int = 1) -> PDDispatcher:
    """A PE and DEs with room for one 60-token call at a time, and host memory whose prefetch share holds two of
    their stored prompts (48 tokens each)."""
    host = int(96 / PREFETCH_HOST_SHARE)
    instances = {"p0": PDInstance("prefill", "p0", "addr-p0", host_capacity_tokens=host)}
    instances |= {f"d{i}": PDInstance("decode", f"d{i}", f"addr-d{i}", 100, host) for i in range(des)}
    config = PDSchedulerConfig(alpha=64, beta=10_000, kv_path=kv_path)  # type: ignore[arg-type]
    return PDDispatcher(instances, ProcessTable(), lambda: 100.0, config, BLOCK)


def test_calls_waiting_for_a_des_room_have_their_stored_context_read_ahead_where_they_will_read_it() -> None:
    d = reading_ahead()
    d.report("p0", 0)
    d.report("d0", 0)
    prepare, _ = prepared(d, "a", list(range(60)), IntakeAnswer(0), ProgramRef("A"))
    assert prepare.plan.push_tag is not None  # a reads its 48 stored tokens on the DE (the queues tie)
    # b waits for the DE's room; its 48 stored tokens are read ahead on the PE's node (its queue is the shorter).
    (ahead,) = d.submit("b", list(range(100, 160)), PARAMS, ProgramRef("B"))
    assert ahead == Prefetch("p0", "b", list(range(100, 160)))
    (ahead,) = d.submit("c", list(range(200, 260)), PARAMS, ProgramRef("C"))
    assert ahead.instance_id == "d0"  # b's read ties the queues again: c reads ahead on the DE's node
    # The queues change; b is still placed where its blocks are: PE-read on p0, and nothing is dropped.
    d.report("p0", 5000)
    d.receive("p0", delta("a", [7], "x", "handoff"))
    _, follow = d.receive("d0", delta("a", [8], "y", "length"))
    (prepare,) = follow
    assert isinstance(prepare, Prepare) and prepare.request_id == "b" and prepare.plan.push_tag is None
    assert d.prefetches == {"pe": 1, "de": 1} and d.placements == {"de": 1, "pe": 1}


def test_read_ahead_is_bounded_by_each_engines_host_room_and_freed_by_placement() -> None:
    d = reading_ahead(kv_path="basic")
    prepared(d, "a", list(range(60)), IntakeAnswer(0), ProgramRef("A"))
    aheads = []
    for i in range(4):
        aheads += d.submit(f"w{i}", list(range(100 * i + 100, 100 * i + 160)), PARAMS, ProgramRef(f"W{i}"))
    # Under basic only the PE reads ahead, and its room (96 tokens) holds two calls' 48 stored tokens.
    assert [(a.instance_id, a.request_id) for a in aheads] == [("p0", "w0"), ("p0", "w1")]
    assert d.prefetch_room() == {"p0": 0, "d0": 96}
    d.receive("p0", delta("a", [7], "x", "handoff"))
    _, follow = d.receive("d0", delta("a", [8], "y", "length"))
    # w0 is placed (its read ahead is its own load now, held by the PE): its room goes to w2.
    assert [(type(x).__name__, x.request_id) for x in follow] == [("Prepare", "w0"), ("Prefetch", "w2")]


def test_a_read_ahead_is_dropped_when_its_call_is_aborted_and_forgotten_with_its_engine() -> None:
    d = reading_ahead(des=2)
    d.report("p0", 1000)  # the DEs' queues are the shorter
    prepared(d, "a", list(range(60)), IntakeAnswer(0), ProgramRef("A"))
    prepared(d, "b", list(range(60, 120)), IntakeAnswer(0), ProgramRef("B"))  # both DEs are full now
    (ahead,) = d.submit("c", list(range(200, 260)), PARAMS, ProgramRef("C"))
    (other,) = d.submit("e", list(range(300, 360)), PARAMS, ProgramRef("E"))
    assert {ahead.instance_id, other.instance_id} == {"d0", "d1"}
    # The aborted call's engine lets its blocks go; the engine that dies takes its read ahead with it, and the
    # call is read ahead again elsewhere.
    assert d.abort("c") == [DropPrefetch(ahead.instance_id, "c")]
    lost = d.instance_lost(other.instance_id, "killed")
    assert not any(isinstance(x, DropPrefetch) for x in lost)
    assert [(type(x).__name__, x.instance_id) for x in lost if isinstance(x, Prefetch)] == [
        ("Prefetch", ahead.instance_id)
    ]


def test_programs_the_table_drops_at_its_size_cap_leave_nothing_behind_in_the_dispatcher() -> None:
    # A program's last call (its tokens, its engines) is kept for its next call while the process table holds the
    # program. At the table's size cap each new program drops an idle one: its last call must go with it, not stay
    # for good (a server with more programs than the cap grew by a call's tokens per program).
    d = dispatcher()
    d.table.max_programs = 2
    for i in range(6):
        rid = f"c{i}"
        prepared(d, rid, list(range(i, i + 40)), IntakeAnswer(0), ProgramRef(f"agent{i}"))
        d.receive("p0", delta(rid, [50], "a", "handoff"))
        d.receive("d0", delta(rid, [51], "b", "length"))
    d.expire()
    assert len(d.table) == 2
    assert set(d._history) == set(d._served) == {"agent4", "agent5"}


def test_under_program_order_an_agents_next_call_goes_before_later_programs_calls() -> None:
    """With ``--queue-order program`` (the engines' default) the queue follows each call's program's first arrival:
    an agent's next turn is placed before a later agent's first, so a few sessions run back to back while their
    KV is in memory; plain call order would put every session's turn behind one of every other's."""
    now = [100.0]
    instances = {"p0": PDInstance("prefill", "p0", "addr-p0"), "d0": PDInstance("decode", "d0", "addr-d0", 80)}

    def run(order_by_program: bool) -> list[str]:
        d = PDDispatcher(
            instances, ProcessTable(), lambda: now[0], PDSchedulerConfig(beta=10_000), BLOCK, order_by_program
        )
        a, b = ProgramRef("a"), ProgramRef("b")
        prepared(d, "a1", list(range(60)), IntakeAnswer(0), a)  # fills the DE: the calls below wait
        now[0] += 1
        assert d.submit("b1", list(range(100, 160)), PARAMS, b) == []
        now[0] += 1
        assert d.submit("a2", list(range(60)) + [7, 8], PARAMS, a) == []
        d.receive("p0", delta("a1", [7], "x", "handoff"))
        _, follow = d.receive("d0", delta("a1", [8], "y", "length"))  # a1 ends: the DE has room for one
        return [p.request_id for p in follow if isinstance(p, Prepare)]

    assert run(order_by_program=False) == ["b1"]
    assert run(order_by_program=True) == ["a2"]
    # A call goes ahead only of calls that came less than PROGRAM_ORDER_LEAD_S before it: b1 is not starved.
    d = PDDispatcher(instances, ProcessTable(), lambda: now[0], PDSchedulerConfig(beta=10_000), BLOCK, True)
    prepared(d, "a1", list(range(60)), IntakeAnswer(0), ProgramRef("a"))
    now[0] += 1
    d.submit("b1", list(range(100, 160)), PARAMS, ProgramRef("b"))
    now[0] += PROGRAM_ORDER_LEAD_S + 1
    d.submit("a2", list(range(60)) + [7, 8], PARAMS, ProgramRef("a"))
    assert [c.request_id for c in d.queue] == ["b1", "a2"]


def test_a_call_of_a_smaller_priority_waits_behind_none_of_a_larger_one() -> None:
    """vLLM's ``priority`` ranks calls queued for a DE's room as the engines rank them: a call of class 0 that comes
    after one of class 1 is placed first once the DE has room (the queue is FIFO within a class)."""
    instances = {"p0": PDInstance("prefill", "p0", "addr-p0"), "d0": PDInstance("decode", "d0", "addr-d0", 80)}
    d = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    prepared(d, "a", list(range(60)), IntakeAnswer(0))  # fills the DE: the calls below wait
    background, urgent = dataclasses.replace(PARAMS, priority=1), dataclasses.replace(PARAMS, priority=0)
    assert d.submit("bg1", list(range(100, 160)), background) == []
    assert d.submit("bg2", list(range(200, 260)), background) == []
    assert d.submit("urgent", list(range(300, 360)), urgent) == []
    assert [c.request_id for c in d.queue] == ["urgent", "bg1", "bg2"]
    d.receive("p0", delta("a", [7], "x", "handoff"))
    _, follow = d.receive("d0", delta("a", [8], "y", "length"))  # a ends: the DE has room for one
    assert [p.request_id for p in follow if isinstance(p, Prepare)] == ["urgent"]


def test_a_call_started_over_goes_back_behind_the_waiting_calls_of_a_smaller_priority() -> None:
    """A call of class 1 whose PE is lost before its handoff goes back to the head of its class in the queue, not
    of the queue: a call of class 0 waiting for the DE's room is placed first."""
    instances = {f"p{i}": PDInstance("prefill", f"p{i}", f"addr-p{i}") for i in range(2)}
    instances["d0"] = PDInstance("decode", "d0", "addr-d0", 80)
    d = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK)
    background, urgent = dataclasses.replace(PARAMS, priority=1), dataclasses.replace(PARAMS, priority=0)
    (prepare,) = d.submit("bg", list(range(60)), background)  # fills the DE
    (send,) = d.prepare_done(prepare, PrepareResult("ok", IntakeAnswer(0)))
    assert isinstance(send, Send) and d.add_done(send, OK) == []
    assert d.submit("urgent", list(range(100, 160)), urgent) == []  # waits for the DE's room
    follow = d.instance_lost(send.instance_id, "gone")  # bg starts over: its room on the DE comes free
    assert [p.request_id for p in follow if isinstance(p, Prepare)] == ["urgent"]
    assert [c.request_id for c in d.queue] == ["bg"]


def test_a_first_token_that_ends_the_call_releases_the_des_half() -> None:
    d = dispatcher()
    prepared(d, "a", list(range(20)), IntakeAnswer(0))
    shown, follow = d.receive("p0", delta("a", [2], "", "stop"))
    assert shown is not None and shown.finished and follow == [AbortOn("d0", "a")]
    assert d.calls == {}


def test_a_pe_lost_before_its_handoff_starts_the_call_over_elsewhere() -> None:
    d = dispatcher(pes=2)
    prepare, send = prepared(d, "a", list(range(40)), IntakeAnswer(0))
    decisions = d.instance_lost(send.instance_id, "gone")
    assert decisions[0] == MarkDead(send.instance_id, "gone")
    assert decisions[1] == AbortOn("d0", "a")  # the DE's prepared half is dropped
    new = decisions[2]
    assert isinstance(new, Prepare) and new.plan.recv_tag != prepare.plan.recv_tag
    assert new.plan.peer != f"addr-{send.instance_id}"
    # The old placement's answers are stale now: the engine that took it is told to drop it.
    assert d.add_done(send, OK) == [AbortOn(send.instance_id, "a")]
    assert d.prepare_done(prepare, PrepareResult("ok", IntakeAnswer(0))) == [AbortOn("d0", "a")]
    assert d.num_failovers == 1


def test_a_de_lost_while_its_pe_prefills_gets_the_handoff_elsewhere_as_a_resumed_call() -> None:
    d = dispatcher(des=2)
    prepare, _ = prepared(d, "a", list(range(40)), IntakeAnswer(0))
    lost = prepare.instance_id
    other = "d1" if lost == "d0" else "d0"
    assert d.instance_lost(lost, "gone") == [MarkDead(lost, "gone")]  # the PE's stream will fail by itself
    shown, follow = d.receive("p0", delta("a", [7], "x", "handoff"))
    assert shown is not None and not shown.finished
    (send,) = follow
    assert isinstance(send, Send) and send.instance_id == other and send.handoff is None
    assert send.resume is not None and send.resume.output_token_ids == (7,) and send.resume.text_chars_sent == 1
    assert d.num_failovers == 1  # (counted as it moves, once)
    assert d.add_done(send, OK) == []
    shown, _ = d.receive(other, delta("a", [8], "y", "length"))
    assert shown is not None and shown.finished


def test_a_de_lost_and_restarted_before_the_handoff_counts_its_call_as_failed_over_once() -> None:
    """The lost DE is back before the PE hands off: the call's Continue goes to it, which holds none of the call and
    turns it down, and the call goes on at the other DE: one failover, counted as it leaves."""
    now = [100.0]
    d = dispatcher(des=2, restarts=RestartPolicy(delay_s=1.0, max_restarts=1), clock=lambda: now[0])
    prepare, _ = prepared(d, "a", list(range(40)), IntakeAnswer(0))
    lost = prepare.instance_id
    d.instance_lost(lost, "gone")
    now[0] = 101.0
    assert d.restarts_due() == [Restart(lost, 1)]
    d.instance_ready(lost)
    assert d.num_failovers == 0  # (not yet: the call may still go on where it was placed)
    _, (cont,) = d.receive("p0", delta("a", [7], "x", "handoff"))
    assert isinstance(cont, Continue) and cont.instance_id == lost
    (send,) = d.continue_done(cont, AddResult("failed", "instance holds no prepared call"))
    assert isinstance(send, Send) and send.instance_id != lost and send.resume is not None
    assert d.num_failovers == 1
    assert d.add_done(send, OK) == [] and d.num_failovers == 1


def test_a_prefill_failed_with_its_push_places_the_call_again_and_loses_no_token() -> None:
    d = dispatcher(des=2)
    prepare, _ = prepared(d, "a", list(range(64)), IntakeAnswer(0, push_blocks=3, push_from=0))
    lost = prepare.instance_id
    other = "d1" if lost == "d0" else "d0"
    assert d.instance_lost(lost, "gone") == [MarkDead(lost, "gone")]  # the DE dies mid-push
    # The PE's step fails at a layer that never lands: nothing reached the client, so the call is placed again, on
    # the DE left, and the error is not shown.
    failed = dataclasses.replace(delta("a", [], "", "error"), stop_reason=KV_STREAM_LOST)
    shown, follow = d.receive("p0", failed)
    assert shown is None and d.num_failovers == 1
    (again,) = follow
    assert isinstance(again, Prepare) and again.instance_id == other and again.plan.recv_tag != prepare.plan.recv_tag
    (send2,) = d.prepare_done(again, PrepareResult("ok", IntakeAnswer(0)))
    assert isinstance(send2, Send) and send2.instance_id == "p0" and d.add_done(send2, OK) == []
    shown, (cont,) = d.receive("p0", delta("a", [7], "x", "handoff"))
    assert shown is not None and shown.new_token_ids == [7] and isinstance(cont, Continue) and cont.instance_id == other
    assert d.continue_done(cont, OK) == []
    shown, _ = d.receive(other, delta("a", [8], "y", "length"))
    assert shown is not None and shown.finished and d.calls == {}


class EnginesThatTakeEverything(DispatcherFrontEnd):
    """The front end's loop (``cluster/client.py``: what the Ray client and ``local_pd`` share) over a dispatcher,
    without Ray: every engine takes what it is sent (a DE-read push of 3 blocks), what reaches them is kept in
    ``sent``, and the test plays the engines' deltas as their pollers hand them over (``_receive``)."""

    def __init__(self, d: PDDispatcher) -> None:
        self.dispatcher, self.streams, self.lock = d, StreamRegistry(), threading.RLock()
        self.sent: list[PDDecision] = []

    def _prepare(self, prepare: Prepare) -> PrepareResult:
        self.sent.append(prepare)
        return PrepareResult("ok", IntakeAnswer(0, push_blocks=3))

    def _pe_holds(self, instance_id: str, prompt: list[int], params: SamplingParams) -> int:
        return 0

    def _add(self, send: Send) -> AddResult:
        self.sent.append(send)
        return OK

    def _continue(self, cont: Continue) -> AddResult:
        self.sent.append(cont)
        return OK

    def _mark_dead(self, mark: MarkDead) -> None:
        self.sent.append(mark)

    def _abort_on(self, abort: AbortOn) -> None:
        self.sent.append(abort)


def test_the_front_end_carries_out_the_placement_again_of_a_call_whose_push_failed() -> None:
    """The PE's failed step shows the client nothing, but places the call again: the front end must carry that
    out too (it once carried out only what came with a shown delta, and the call waited in ``preparing`` for ever,
    its client with it)."""
    engines = EnginesThatTakeEverything(dispatcher(des=2))
    failed = dataclasses.replace(delta("a", [], "", "error"), stop_reason=KV_STREAM_LOST)

    async def client() -> list[RequestDelta]:
        stream = engines.submit("a", list(range(64)), PARAMS)
        prepare, send = engines.sent
        assert isinstance(prepare, Prepare) and isinstance(send, Send) and send.handoff is not None
        lost = prepare.instance_id
        engines._lose(lost, "gone")  # the DE dies mid-push, and the PE's step fails at a layer that never lands
        assert engines._receive("p0", failed) is None
        mark, again, send2 = engines.sent[2:]
        assert mark == MarkDead(lost, "gone")
        assert isinstance(again, Prepare) and again.instance_id != lost and again.plan.recv_tag != prepare.plan.recv_tag
        assert isinstance(send2, Send) and send2.instance_id == "p0" and send2.handoff is not None
        assert engines.dispatcher.calls["a"].phase == "prefilling"
        engines._receive("p0", delta("a", [7], "x", "handoff"))
        assert engines.sent[-1] == Continue(again.instance_id, "a", Resume((7,), 1))
        engines._receive(again.instance_id, delta("a", [8], "y", "length"))
        return [d async for d in stream]

    deltas = asyncio.run(asyncio.wait_for(client(), timeout=10))
    assert [t for d in deltas for t in d.new_token_ids] == [7, 8] and deltas[-1].finish_reason == "length"
    assert engines.dispatcher.num_stream_losses == 1 and engines.dispatcher.calls == {}


def test_a_call_whose_pushes_keep_failing_gets_the_error_in_the_end() -> None:
    d = dispatcher()
    prepared(d, "a", list(range(64)), IntakeAnswer(0, push_blocks=3))
    failed = dataclasses.replace(delta("a", [], "", "error"), stop_reason=KV_STREAM_LOST)
    for _ in range(MAX_STREAM_LOSSES):
        shown, follow = d.receive("p0", failed)
        assert shown is None
        again = next(x for x in follow if isinstance(x, Prepare))
        (send,) = d.prepare_done(again, PrepareResult("ok", IntakeAnswer(0, push_blocks=3)))
        d.add_done(send, OK)
    shown, _ = d.receive("p0", failed)
    assert shown is not None and shown.finish_reason == "error" and d.calls == {}
    # Any other failed step is the client's error at once.
    prepared(d, "b", list(range(64)), IntakeAnswer(0))
    shown, _ = d.receive("p0", dataclasses.replace(delta("b", [], "", "error"), stop_reason="engine step failed"))
    assert shown is not None and shown.finish_reason == "error"


def test_a_de_lost_while_decoding_resends_the_call_with_every_token_so_far() -> None:
    d = dispatcher(des=2)
    prepare, _ = prepared(d, "a", list(range(40)), IntakeAnswer(0))
    de = prepare.instance_id
    (cont,) = d.receive("p0", delta("a", [7], "x", "handoff"))[1]
    d.continue_done(cont, OK)
    d.receive(de, delta("a", [8, 9], "yz"))
    decisions = d.instance_lost(de, "gone")
    send = decisions[1]
    assert isinstance(send, Send) and send.instance_id != de
    assert send.resume.output_token_ids == (7, 8, 9) and send.resume.text_chars_sent == 3
    assert d.receive(de, delta("a", [10], "w"))[0] is None  # a stale delta from the lost DE


def test_an_abort_reaches_every_engine_holding_a_half_of_the_call() -> None:
    d = dispatcher()
    prepared(d, "a", list(range(40)), IntakeAnswer(0))
    assert set(d.abort("a")) == {AbortOn("p0", "a"), AbortOn("d0", "a")}
    (prepare,) = d.submit("b", list(range(40)), PARAMS)
    assert d.abort("b") == []  # its Prepare is under way: the answer finds it gone and drops it there
    assert d.prepare_done(prepare, PrepareResult("ok", IntakeAnswer(0))) == [AbortOn("d0", "b")]


def test_without_a_live_decode_engine_calls_fail_as_unavailable() -> None:
    d = dispatcher()
    prepared(d, "a", list(range(40)), IntakeAnswer(0))
    d.instance_lost("d0", "gone")
    assert not d.is_alive()
    (fail,) = d.receive("p0", delta("a", [7], "x", "handoff"))[1]
    assert isinstance(fail, Fail) and fail.reason == "unavailable"
    (fail,) = d.submit("b", [1, 2, 3], PARAMS)
    assert isinstance(fail, Fail) and fail.reason == "unavailable"


def test_roles_come_from_the_flags_and_bad_values_fail_at_start_up() -> None:
    import pytest

    from boundless.cli import build_parser
    from boundless.config import ClusterConfig, ConfigError, from_flags

    args = build_parser().parse_args(["serve", "--prefill-instances", "2", "--kv-handoff-timeout-s", "5"])
    cluster = from_flags(ClusterConfig, args)
    assert cluster.disaggregated and cluster.roles == (2, 1) and cluster.kv_handoff_timeout_s == 5
    assert not ClusterConfig().disaggregated
    with pytest.raises(ConfigError, match="--kv-transport"):
        ClusterConfig(prefill_instances=1, kv_transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="--decode-instances"):
        ClusterConfig(decode_instances=-1)


def test_a_lost_engine_is_refiled_restarted_and_placed_on_only_once_ready_holding_nothing() -> None:
    now = [100.0]
    d = dispatcher(des=2, restarts=RestartPolicy(delay_s=5.0, max_restarts=1), clock=lambda: now[0])
    program = ProgramRef("agent")
    prepare, _ = prepared(d, "a", list(range(40)), IntakeAnswer(0), program)
    de = prepare.instance_id
    d.receive("p0", delta("a", [7], "x", "handoff"))
    d.receive(de, delta("a", [8], "y", "length"))
    next_turn = PDCall("next", list(range(48)), PARAMS, program)
    assert d._in_memory(next_turn, 32).get(de) == 32  # it holds the agent's context
    d.instance_lost(de, "gone")
    assert d.load_index.live_view(de) is None  # refiled as dead (the router's index)
    other = next(iid for iid in ("d0", "d1") if iid != de)
    now[0] = 105.0
    assert d.restarts_due() == [Restart(de, 1)]
    for i in range(3):  # starting: every call goes to the other DE
        (prep,) = d.submit(f"s{i}", list(range(40)), PARAMS)
        assert isinstance(prep, Prepare) and prep.instance_id == other
    assert d.instance_ready(de) == []  # nothing queued
    assert d.load_index.live_view(de) is not None
    assert de not in d._in_memory(next_turn, 32)  # restarted empty: the agent's context is not counted on it
    (prep,) = d.submit("later", list(range(40)), PARAMS)
    assert isinstance(prep, Prepare) and prep.instance_id == de  # the idle one, from its first heartbeat


def test_engines_restarted_at_new_transport_addresses_are_sent_and_read_from_there() -> None:
    # NIXL and Mooncake bind a fresh port in the new process: its KV address is not its predecessor's.
    now = [100.0]
    d = dispatcher(restarts=RestartPolicy(delay_s=1.0), clock=lambda: now[0])
    for iid in ("p0", "d0"):
        d.instance_lost(iid, "gone")
    now[0] = 101.0
    assert {r.instance_id for r in d.restarts_due()} == {"p0", "d0"}
    assert d.instance_ready("p0", "addr-p0-new") == []
    assert d.instance_ready("d0", "") == []  # a transport that kept its address (shm) says nothing new
    d.instance_ready("p0", "addr-stray")  # ready twice is no news, nor a new address
    prepare, send = prepared(d, "a", list(range(40)), IntakeAnswer(send_from_block=1))
    assert prepare.plan.peer == "addr-p0-new"  # the DE reads from the new PE
    assert send.handoff is not None and send.handoff.peer == "addr-d0"
    d.instance_lost("d0", "gone again")
    now[0] = 110.0
    assert d.restarts_due() == [Restart("d0", 2)]
    d.instance_ready("d0", "addr-d0-new")
    _, send = prepared(d, "b", list(range(40)), IntakeAnswer(send_from_block=1))
    assert send.handoff is not None and send.handoff.peer == "addr-d0-new"  # the PE sends to the new DE


def test_calls_wait_for_the_only_decode_engine_while_it_restarts_and_fail_once_it_cannot() -> None:
    now = [100.0]
    d = dispatcher(restarts=RestartPolicy(delay_s=1.0, max_restarts=1), clock=lambda: now[0])
    d.instance_lost("d0", "gone")
    assert d.submit("a", list(range(40)), PARAMS) == []  # queued: a decode engine is coming back
    now[0] = 101.0
    assert d.restarts_due() == [Restart("d0", 1)]
    (prepare,) = d.instance_ready("d0")  # back: the waiting call is placed on it
    assert isinstance(prepare, Prepare) and prepare.instance_id == "d0" and prepare.request_id == "a"
    d.instance_lost("d0", "gone again")  # no restart left: the queue's calls fail as before restarts
    assert d.restarts.state("d0") == "retired"
    (fail,) = d.submit("b", [1, 2, 3], PARAMS)
    assert isinstance(fail, Fail) and fail.reason == "unavailable"


def _decoding_on_d0(d, rids: tuple[str, ...]) -> None:
    for rid in rids:
        prepared(d, rid, list(range(40)), IntakeAnswer(0))
        (cont,) = d.receive("p0", delta(rid, [7], "x", "handoff"))[1]
        d.continue_done(cont, OK)
        d.receive("d0", delta(rid, [8, 9], "yz"))


def test_a_call_decoding_on_the_only_decode_engine_waits_for_its_restart_and_goes_on_there() -> None:
    """The only DE lost mid-decode (a review's kill of it): its calls keep their tokens and wait for its restart
    (they failed at once), then go on there as resumed calls; an abort meanwhile drops one; lost again with no restart
    left, they fail as unavailable."""
    now = [100.0]
    d = dispatcher(restarts=RestartPolicy(delay_s=1.0, max_restarts=1), clock=lambda: now[0])
    _decoding_on_d0(d, ("a", "b", "c"))
    decisions = d.instance_lost("d0", "killed")
    assert not any(isinstance(x, (Fail, Send)) for x in decisions)  # they wait: a DE is coming back
    assert d.abort("b") == []
    now[0] = 101.0
    assert d.restarts_due() == [Restart("d0", 1)]
    sends = [x for x in d.instance_ready("d0") if isinstance(x, Send)]
    assert [(x.request_id, x.instance_id, x.resume.output_token_ids) for x in sends] == [
        ("a", "d0", (7, 8, 9)),
        ("c", "d0", (7, 8, 9)),
    ]
    for send in sends:
        d.add_done(send, OK)
    fails = {x.request_id: x.reason for x in d.instance_lost("d0", "killed again") if isinstance(x, Fail)}
    assert fails == {"a": "unavailable", "c": "unavailable"}


def test_calls_waiting_for_a_decode_engine_fail_when_its_restart_fails_with_none_left() -> None:
    now = [100.0]
    d = dispatcher(restarts=RestartPolicy(delay_s=1.0, max_restarts=1), clock=lambda: now[0])
    _decoding_on_d0(d, ("a",))
    assert not any(isinstance(x, Fail) for x in d.instance_lost("d0", "killed"))
    now[0] = 101.0
    assert d.restarts_due() == [Restart("d0", 1)]
    fails = [x for x in d.instance_lost("d0", "its restart failed") if isinstance(x, Fail)]
    assert [(x.request_id, x.reason) for x in fails] == [("a", "unavailable")]


def test_a_call_past_the_queues_bound_is_refused_busy_and_nothing_of_it_is_kept() -> None:
    """Prefill and decode engines' front end had no bound on its queue: a request of 12,800 samples was queued call
    by call (each placement walking the queue) and held the server minutes, where one engine answers a 429 past
    ``--max-waiting``."""
    instances = {"p0": PDInstance("prefill", "p0", "addr-p0"), "d0": PDInstance("decode", "d0", "addr-d0", 100)}
    d = PDDispatcher(instances, ProcessTable(), lambda: 100.0, PDSchedulerConfig(beta=10_000), BLOCK, max_queued=2)
    prepared(d, "a", list(range(60)), IntakeAnswer(0))  # (the DE's room taken: the next calls wait)
    assert d.submit("b", list(range(60)), PARAMS) == [] and d.submit("c", list(range(60)), PARAMS) == []
    (fail,) = d.submit("d", list(range(60)), PARAMS, ProgramRef("agent"))
    assert isinstance(fail, Fail) and fail.reason == "busy"
    assert [c.request_id for c in d.queue] == ["b", "c"] and "d" not in d.calls
    assert "agent" not in d.table  # (its program was not counted as called)
