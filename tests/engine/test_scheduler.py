"""The scheduler as a pure function of its state and a clock: no model runs here."""

from __future__ import annotations

import pytest

from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import AHEAD_TOKEN, Scheduler, SchedulerOutput
from boundless.kv.manager import KVCacheManager
from boundless.kv.transfer import DEVICE, HOST
from boundless.programs.policies import PLASPolicy, QueueConfig
from boundless.programs.policy import FCFSPolicy
from boundless.programs.ref import ProgramRef


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, caching: bool = True):
    clock = FakeClock()
    kv = KVCacheManager(num_blocks, block_size, caching, "fp")
    return Scheduler(kv, FCFSPolicy(), clock, max_num_batched_tokens=budget, max_num_seqs=16), clock


def request(rid: str, n: int, t: float, first: int = 0, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), arrival_time=t)


def run_step(s: Scheduler, sampled_token: int = 7) -> SchedulerOutput:
    """Schedule, pretend the model ran, and append a token for every chunk that samples."""
    out = s.schedule()
    s.advance(out, service_s=0.01)
    for c in out.chunks:
        if c.sample:
            s.requests[c.request_id].append_output(sampled_token)
    return out


def test_chunked_prefill_and_decode_share_a_step() -> None:
    s, _ = make_scheduler(budget=10)
    s.add(request("a", 4, 0.0))
    s.add(request("b", 20, 1.0, first=100))
    out = run_step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 4, True), ("b", 6, False)]
    out = run_step(s)
    # a decodes one token while b continues its prompt with what is left of the budget.
    assert [(c.request_id, len(c.token_ids), c.start_pos) for c in out.chunks] == [("a", 1, 4), ("b", 9, 6)]
    out = run_step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 1, True), ("b", 5, True)]
    assert s.requests["b"].num_computed_tokens == 20


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    s, _ = make_scheduler(budget=64)
    s.add(request("a", 16, 0.0))
    run_step(s)
    s.add(request("b", 18, 1.0))  # shares a's first 16 tokens
    out = run_step(s)
    chunk_b = next(c for c in out.chunks if c.request_id == "b")
    assert chunk_b.start_pos == 16 and len(chunk_b.token_ids) == 2
    assert s.requests["b"].num_cached_tokens == 16


def test_a_resumed_request_counts_cached_tokens_of_its_prompt_only() -> None:
    """A call resumed on another instance (a failover) comes with its outputs so far, which that instance may hold
    cached too: its cached tokens and the hit count are of its prompt only (they exceeded the prompt, and the hit
    rate went past 1)."""
    s, _ = make_scheduler(budget=64)
    s.add(request("a", 24, 0.0))  # its prompt: the resumed call's prompt and outputs so far
    run_step(s)
    prompt, outputs = list(range(8)), list(range(8, 24))
    s.add(Request("r", prompt, SamplingParams(max_tokens=30), arrival_time=1.0, output_token_ids=outputs))
    out = run_step(s)
    chunk = next(c for c in out.chunks if c.request_id == "r")
    assert chunk.start_pos == 20  # it computes only its last block's tokens: the rest is cached
    assert s.requests["r"].num_cached_tokens == 8 and s.stats.num_prompt_tokens_cached == 8
    assert s.stats.cached_tokens_by_tier == {DEVICE: 8}


def test_memory_pressure_preempts_the_latest_arrival() -> None:
    s, _ = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    s.add(request("old", 8, 0.0, max_tokens=20))
    s.add(request("new", 8, 1.0, first=50, max_tokens=20))
    run_step(s)  # 2 + 2 blocks
    for _ in range(4):
        run_step(s)  # both grow to 12 tokens: 3 + 3 blocks, the pool is full
    out = run_step(s)  # both need a fourth block: "new" gives way
    assert out.preempted_ids == ["new"]
    assert s.requests["new"].status is RequestStatus.PREEMPTED
    assert s.requests["new"].num_computed_tokens == 0
    assert s.stats.num_preemptions == 1
    # Once "old" finishes, "new" is recomputed from its prompt plus the tokens it had produced.
    s.finish("old", RequestStatus.FINISHED_LENGTH)
    out = run_step(s)
    (chunk,) = out.chunks
    assert chunk.request_id == "new" and chunk.start_pos == 0 and chunk.sample
    assert len(chunk.token_ids) == s.requests["new"].num_tokens - 1


def test_finish_frees_blocks_and_reports_once() -> None:
    s, _ = make_scheduler()
    s.add(request("a", 5, 0.0))
    run_step(s)
    assert s.kv.num_allocated_blocks("a") == 2
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_used == 0
    # A step with nothing to run is not launched: the departure goes with the next step that runs (whose executor
    # forgets the request's sampling state), and with it alone.
    assert s.schedule().finished_ids == []
    s.add(request("b", 5, 1.0))
    assert run_step(s).finished_ids == ["a"]
    assert run_step(s).finished_ids == []


def test_policy_decides_order_not_queue_position() -> None:
    s, _ = make_scheduler(budget=4)
    s.add(request("late", 4, 5.0))
    s.add(request("early", 4, 1.0, first=10))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["early"]


def _ranked(rid: str, t: float, priority: int, first: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(first, first + 4)), SamplingParams(max_tokens=max_tokens, priority=priority), t)


def test_a_requests_priority_class_comes_before_the_policys_order() -> None:
    """vLLM's ``priority``: smaller first, whatever the arrival (fcfs) within the step's one slot; equal classes
    keep the policy's order."""
    s, _ = make_scheduler(budget=4)
    s.add(_ranked("early-low", 1.0, 5, 0))
    s.add(_ranked("late-high", 9.0, -2, 10))
    s.add(_ranked("mid-high", 5.0, -2, 20))
    assert [c.request_id for c in s.schedule().chunks] == ["mid-high"]


def test_a_higher_priority_arrival_takes_a_running_requests_slot() -> None:
    """With one sequence slot, a running request of priority 1 gives its slot to one of priority 0 that arrives
    later (keeping its KV), and runs again once that one has finished."""
    s, clock = make_scheduler(budget=16)
    s.max_num_seqs = 1
    s.add(_ranked("background", 0.0, 1, 0, max_tokens=20))
    for _ in range(3):
        clock.now += 1.0
        assert [c.request_id for c in run_step(s).chunks] == ["background"]
    s.add(_ranked("urgent", clock.now, 0, 40, max_tokens=2))
    assert [c.request_id for c in run_step(s).chunks] == ["urgent"]
    assert s.requests["background"].status is RequestStatus.RUNNING and s.kv.num_allocated_blocks("background") > 0
    run_step(s)
    s.finish("urgent", RequestStatus.FINISHED_LENGTH)
    assert [c.request_id for c in run_step(s).chunks] == ["background"]


def test_priority_must_be_an_integer() -> None:
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=1.5)  # type: ignore[arg-type]


def _priority_scheduler(num_blocks: int, host_blocks: int, max_num_seqs: int = 16):
    clock = FakeClock()
    kv = KVCacheManager(num_blocks, 4, False, "fp", num_host_blocks=host_blocks)
    policy = PLASPolicy(QueueConfig(base_s=1.0, growth=4.0))
    return Scheduler(kv, policy, clock, max_num_batched_tokens=64, max_num_seqs=max_num_seqs), clock, policy


def test_a_call_that_loses_its_place_keeps_its_kv() -> None:
    s, clock, _ = _priority_scheduler(num_blocks=32, host_blocks=0, max_num_seqs=1)
    long_call = Request("long", list(range(8)), SamplingParams(max_tokens=50), 0.0, program=ProgramRef("L"))
    s.add(long_call)
    for _ in range(3):
        clock.now += 1.0
        out = s.schedule()
        s.advance(out, service_s=1.0)  # each step charges 1 s: the call falls to lower queues
        for c in out.chunks:
            s.requests[c.request_id].append_output(5)
    short = Request("short", list(range(100, 104)), SamplingParams(max_tokens=5), clock.now, program=ProgramRef("S"))
    s.add(short)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["short"]  # the top queue wins the only slot
    assert long_call.status is RequestStatus.RUNNING and s.kv.num_allocated_blocks("long") == 3  # kept its KV
    assert s.stats.num_kept == 1 and s.stats.num_preemptions == 0


def test_memory_pressure_swaps_before_it_recomputes() -> None:
    s, _, _ = _priority_scheduler(num_blocks=4, host_blocks=4)
    low = Request("low", list(range(12)), SamplingParams(max_tokens=50), 0.0, program=ProgramRef("L"))
    s.add(low)
    out = s.schedule()
    s.advance(out, service_s=2.0)  # 2 s: low drops to Q2
    low.append_output(1)
    high = Request("high", list(range(50, 58)), SamplingParams(max_tokens=5), 1.0, program=ProgramRef("H"))
    s.add(high)
    out = s.schedule()
    # high needs 2 blocks of 4; low holds 3 (plus needs a 4th): low's KV goes to host memory.
    assert [c.request_id for c in out.chunks] == ["high"]
    assert low.status is RequestStatus.SWAPPED and low.num_computed_tokens == 12
    assert [(t.src.tier, t.dst.tier) for t in out.transfers] == [(DEVICE, HOST)] * 3
    assert s.stats.num_swapped_out == 1 and s.stats.num_recomputed == 0
    s.finish("high", RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["low"]
    assert [(t.src.tier, t.dst.tier) for t in out.transfers] == [(HOST, DEVICE)] * 3
    assert [t.dst.block_id for t in out.transfers] == out.chunks[0].block_ids[:3]  # back into its own table
    assert out.chunks[0].start_pos == 12  # nothing recomputed
    assert low.status is RequestStatus.RUNNING


def test_a_failed_step_fails_the_requests_whose_kv_it_was_moving_and_forgets_its_blocks() -> None:
    clock = FakeClock()
    kv = KVCacheManager(4, 4, True, "fp", num_host_blocks=4)
    s = Scheduler(kv, PLASPolicy(QueueConfig(base_s=1.0, growth=4.0)), clock, 64, 16)
    low = Request("low", list(range(12)), SamplingParams(max_tokens=50), 0.0, program=ProgramRef("L"))
    s.add(low)
    out = s.schedule()
    s.advance(out, service_s=2.0)
    low.append_output(1)
    high_prompt = list(range(50, 58))
    s.add(Request("high", high_prompt, SamplingParams(max_tokens=5), 1.0, program=ProgramRef("H")))
    out = s.schedule()  # high's prefill, and low swapped out to make room: then the step raises
    assert [c.request_id for c in out.chunks] == ["high"] and low.status is RequestStatus.SWAPPED
    assert s.step_failed(out) == ["high", "low"]  # low's host blocks were never filled
    # high's two full blocks were named when allocated, but the forward pass never wrote them.
    assert kv.find_cached_prefix("again", high_prompt + [1]).num_tokens == 0


# -- steps decided ahead (asynchronous scheduling) ------------------------------------------------


def record(s: Scheduler, out: SchedulerOutput, sampled_token: int) -> None:
    """The step ran: its tokens counted, and ``sampled_token`` appended for each chunk that samples."""
    s.advance(out, service_s=0.01)
    for c in out.chunks:
        if c.sample and c.request_id in s.requests:
            s.requests[c.request_id].append_output(sampled_token)


def test_a_step_decided_ahead_is_the_ordinary_decision_after_the_step_in_flight() -> None:
    """The step after one in flight, decided before its tokens are known (a prompt's rest beside a decode): the
    decisions of ``test_chunked_prefill_and_decode_share_a_step``, the decode's input a placeholder for the token the
    step in flight draws; the requests' counts as they were once it is decided."""
    s, _ = make_scheduler(budget=10)
    s.add(request("a", 4, 0.0))
    s.add(request("b", 20, 1.0, first=100))
    first = s.schedule()
    ahead = s.schedule_ahead(first)
    assert ahead is not None and ahead.decided_ahead
    assert [(c.request_id, c.token_ids, c.start_pos) for c in ahead.chunks] == [
        ("a", [AHEAD_TOKEN], 4),
        ("b", list(range(106, 115)), 6),
    ]
    a, b = s.requests["a"], s.requests["b"]
    assert (a.num_computed_tokens, a.all_token_ids, a.output_token_ids, b.num_computed_tokens) == (
        0,
        [0, 1, 2, 3],
        [],
        0,
    )
    assert s.in_flight == {"a": 5, "b": 15}  # (both steps' tokens)
    record(s, first, 7)
    record(s, ahead, 8)
    assert s.in_flight == {} and (a.num_computed_tokens, b.num_computed_tokens) == (5, 15)
    out = run_step(s)
    assert [(c.request_id, c.token_ids, c.start_pos) for c in out.chunks] == [
        ("a", [8], 5),
        ("b", list(range(115, 120)), 15),
    ]


def test_a_step_decided_ahead_admits_and_leaves_out_an_output_that_ends_in_flight() -> None:
    s, _ = make_scheduler(budget=10)
    s.add(request("a", 4, 0.0, max_tokens=1))
    first = s.schedule()
    s.add(request("c", 3, 1.0, first=50))
    ahead = s.schedule_ahead(first)
    assert ahead is not None
    assert [(c.request_id, c.start_pos, len(c.token_ids)) for c in ahead.chunks] == [("c", 0, 3)]
    assert s.requests["a"] in s.running  # (it ends when the step in flight is recorded)
    record(s, first, 7)
    record(s, ahead, 8)
    assert s.requests["a"].num_output_tokens == 1 and s.requests["c"].num_computed_tokens == 3


def test_a_block_a_placeholder_fills_is_named_by_its_real_tokens() -> None:
    """A decode decided ahead fills a block whose last token is the placeholder: the block is named once its token is
    known (at the request's next allocation), so a later request with those tokens finds it cached."""
    s, _ = make_scheduler(budget=16)
    s.add(request("a", 3, 0.0))
    first = s.schedule()
    s.add(request("c", 3, 1.0, first=50))  # (waiting: the decision ahead is the ordinary one)
    ahead = s.schedule_ahead(first)
    assert ahead is not None and (ahead.chunks[0].token_ids, ahead.chunks[0].start_pos) == ([AHEAD_TOKEN], 3)
    record(s, first, 60)
    record(s, ahead, 61)
    run_step(s)
    s.add(Request("d", [0, 1, 2, 60, 99], SamplingParams(max_tokens=4), arrival_time=2.0))
    run_step(s)
    assert s.requests["d"].num_cached_tokens == 4


def test_a_step_decided_ahead_swaps_nothing_in() -> None:
    """Host blocks may still be landing from copies queued behind the step in flight: a step decided ahead does not
    swap a request in; it ends there, and the ordinary step after it does."""
    clock = FakeClock()
    kv = KVCacheManager(8, 4, True, "fp", num_host_blocks=8)
    s = Scheduler(kv, PLASPolicy(QueueConfig(base_s=1.0, growth=4.0)), clock, 8, 16)
    low = Request("low", list(range(24)), SamplingParams(max_tokens=50), 0.0, program=ProgramRef("L"))
    s.add(low)
    for _ in range(3):
        s.advance(s.schedule(), service_s=2.0)  # (low drops to a lower queue)
    low.append_output(1)
    s.add(Request("high", list(range(50, 56)), SamplingParams(max_tokens=5), 1.0, program=ProgramRef("H")))
    first = s.schedule()
    assert [c.request_id for c in first.chunks] == ["high"] and low.status is RequestStatus.SWAPPED
    s.finish("high", RequestStatus.FINISHED_ABORTED)  # (aborted while its step runs: room for low again)
    s.add(Request("mid", list(range(60, 63)), SamplingParams(max_tokens=5), 2.0, program=ProgramRef("M")))
    ahead = s.schedule_ahead(first)
    assert ahead is not None and [c.request_id for c in ahead.chunks] == ["mid"]
    assert low.status is RequestStatus.SWAPPED and not ahead.transfers
    record(s, first, 7)
    # The next decision is the ordinary one: a run of steps ahead, each passing low over, would keep it out for as
    # long as mid runs (found so: 15 steps ahead, until mid's growth had taken the room low's swap-in needed).
    assert s.schedule_ahead(ahead) is None
    record(s, ahead, 8)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["mid", "low"] and low.status is RequestStatus.RUNNING
    assert [t.src.tier for t in out.transfers if t.dst.tier == DEVICE] == [HOST] * 6  # (the swap-in)


def test_a_step_decided_ahead_ends_at_a_prefix_hit_in_host_memory() -> None:
    """A waiting request whose prefix is partly in host memory ends a step decided ahead (a host block may still be
    landing from a copy queued behind the step in flight, and computing it again would throw away what memory holds):
    the next decision is the ordinary one, which loads the host block, as the engine without asynchronous scheduling
    does."""
    s, _ = make_scheduler(num_blocks=8, budget=8)
    s.kv = kv = KVCacheManager(8, 4, True, "fp", num_host_blocks=8)
    s.add(request("x", 8, 0.0, max_tokens=1))
    run_step(s)
    s.finish("x", RequestStatus.FINISHED_LENGTH)
    s.add(request("y", 24, 1.0, first=100, max_tokens=1))
    while s.requests["y"].num_output_tokens == 0:
        run_step(s)
    s.finish("y", RequestStatus.FINISHED_LENGTH)
    s.add(request("z", 3, 2.0, first=200))
    first = s.schedule()  # (z's block is x's second, the first in the pool's order: its KV goes down to host memory)
    s.add(request("peer", 12, 3.0))  # x's two blocks, then its own
    assert kv.find_cached_prefix("peer", list(range(12))).tiers == [DEVICE, HOST]
    ahead = s.schedule_ahead(first)
    assert ahead is not None
    assert [(c.request_id, c.start_pos) for c in ahead.chunks] == [("z", 3)]  # (peer waits)
    assert all(t.dst.tier == HOST for t in ahead.transfers)  # (nothing read back)
    record(s, first, 7)
    assert s.schedule_ahead(ahead) is None  # (the ordinary decision next: a run of steps ahead would pass peer over)
    record(s, ahead, 8)
    out = s.schedule()
    assert [(c.request_id, c.start_pos) for c in out.chunks] == [("z", 4), ("peer", 8)]
    assert s.requests["peer"].num_cached_tokens == 8
    # Its prefix loaded, both blocks: z's new block took the first one's device copy meanwhile (down to host memory).
    assert [t.src.tier for t in out.transfers if t.dst.tier == DEVICE] == [HOST, HOST]


def test_a_step_decided_ahead_evicts_nobody() -> None:
    """A prefix hit on free cached blocks takes blocks the free-block guard counted free, and may leave a request of
    the step in flight short of blocks in the step decided ahead: it is left out, not evicted (the step in flight may
    be writing its blocks), and the next decision is the ordinary one, after that step, which may preempt."""
    kv = KVCacheManager(14, 4, True, "fp")
    s = Scheduler(kv, FCFSPolicy(), FakeClock(), max_num_batched_tokens=16, max_num_seqs=4)
    s.add(Request("P", list(range(1000, 1032)), SamplingParams(max_tokens=1), arrival_time=0.0))
    while s.requests["P"].num_output_tokens == 0:
        run_step(s)
    s.finish("P", RequestStatus.FINISHED_LENGTH)  # (its 8 blocks stay cached, free)
    s.add(Request("A", list(range(7)), SamplingParams(max_tokens=50), arrival_time=2.0))
    s.add(Request("V", list(range(10, 17)), SamplingParams(max_tokens=50), arrival_time=3.0))
    run_step(s)
    first = s.schedule()  # A's and V's first decodes
    s.add(Request("B", list(range(1000, 1032)) + [5], SamplingParams(max_tokens=5), arrival_time=1.0))  # P's blocks
    ahead = s.schedule_ahead(first)
    assert ahead is not None and [(c.request_id, c.start_pos) for c in ahead.chunks] == [("B", 32), ("A", 8)]
    v = s.requests["V"]
    assert not ahead.preempted_ids and v.status is RequestStatus.RUNNING and v.num_computed_tokens == 7
    record(s, first, 9)
    assert s.schedule_ahead(ahead) is None  # (V waits for the ordinary decision)
    record(s, ahead, 9)
    out = s.schedule()
    assert out.preempted_ids == ["V"] and [c.request_id for c in out.chunks] == ["B", "A"]


def test_a_decision_ahead_that_raises_leaves_the_requests_as_they_were() -> None:
    """A fault inside a decision ahead: the requests in flight lose their placeholders and pretended counts, the
    in-flight counts are the step in flight's alone, and the departures it had taken go to the next step."""
    s, _ = make_scheduler(budget=10)
    s.add(request("a", 4, 0.0))
    s.add(request("b", 20, 1.0, first=100))
    first = s.schedule()
    s.add(request("x", 3, 2.0, first=50))
    s.finish("x", RequestStatus.FINISHED_ABORTED)

    class FailingPolicy:
        """The policy, but its priority raises: the decision fails after it began."""

        def __init__(self, policy: FCFSPolicy) -> None:
            self.policy = policy

        def __getattr__(self, name: str) -> object:
            return getattr(self.policy, name)

        def priority(self, *args: object) -> float:
            raise RuntimeError("a fault in the decision")

    policy = s.policy
    s.policy = FailingPolicy(policy)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="a fault in the decision"):
        s.schedule_ahead(first)
    s.policy = policy
    a, b = s.requests["a"], s.requests["b"]
    assert (a.num_computed_tokens, a.all_token_ids, a.output_token_ids, b.num_computed_tokens) == (
        0,
        [0, 1, 2, 3],
        [],
        0,
    )
    assert s.in_flight == {"a": 4, "b": 6} and s.running == [a, b]
    record(s, first, 7)
    assert s.schedule().finished_ids == ["x"]
