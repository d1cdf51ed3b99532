"""The scheduler with a request longer than one pool (KV lending: its ``max_model_len`` is the cluster's). No model
runs here; a move of its leading blocks to a creditor is ``KVCacheManager.lend_leading_blocks``, as the lending
agent makes it (engine/lending.py)."""

from __future__ import annotations

from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import Scheduler, SchedulerOutput
from boundless.kv.manager import KVCacheManager, LentSpan
from boundless.kv.transfer import DEVICE, HOST
from boundless.programs.policies import PLASPolicy, QueueConfig
from boundless.programs.policy import FCFSPolicy
from boundless.programs.ref import ProgramRef

BLOCK = 4
POOL = 8  # blocks: 32 tokens
BUDGET = 16


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(host_blocks: int = 0, policy=None, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(POOL, BLOCK, caching, "fp", num_host_blocks=host_blocks)
    return Scheduler(kv, policy or FCFSPolicy(), Clock(), max_num_batched_tokens=BUDGET, max_num_seqs=4)


def _long(program: str | None = None) -> Request:
    """60 prompt tokens: 15 blocks, almost twice the pool."""
    ref = ProgramRef(program) if program else None
    return Request("long", list(range(60)), SamplingParams(max_tokens=4), arrival_time=0.0, program=ref)


def _step(s: Scheduler, service_s: float = 0.01) -> SchedulerOutput:
    out = s.schedule()
    s.advance(out, service_s)
    for c in out.chunks:
        if c.sample:
            s.requests[c.request_id].append_output(7)
    return out


def _chunks(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    return [(c.request_id, c.start_pos, len(c.token_ids), c.first_block) for c in out.chunks]


def test_a_request_that_fills_the_pool_keeps_its_blocks_until_a_move_lets_it_grow() -> None:
    s = _scheduler()
    s.add(_long())
    _step(s)
    _step(s)  # 32 tokens: its 8 blocks fill the pool
    out = _step(s)
    # Evicting it would only bring it back to the same wall (and drop its KV): it waits, keeping its blocks.
    assert out.chunks == [] and out.preempted_ids == [] and s.stats.num_preemptions == 0
    assert s.requests["long"].status is RequestStatus.RUNNING and s.kv.num_allocated_blocks("long") == POOL
    s.kv.lend_leading_blocks("long", LentSpan("creditor", "m1", 6))  # 6 blocks move: 6 free here
    assert _chunks(_step(s)) == [("long", 32, 16, 6)]
    # Its next chunk (to 60 tokens) needs 9 local blocks: it computes the 8 that fit the pool, then waits again.
    assert _chunks(_step(s)) == [("long", 48, 8, 6)]
    assert _step(s).chunks == [] and s.stats.num_preemptions == 0


def test_a_request_held_back_by_the_deadlock_breaker_gives_up_its_blocks_and_waits_for_its_release() -> None:
    s = _scheduler()
    s.add(_long())
    short = Request("short", list(range(100, 108)), SamplingParams(max_tokens=2), arrival_time=1.0)
    _step(s)
    assert not s.waits_for_room(s.requests["long"])  # it grows still
    _step(s)
    assert s.waits_for_room(s.requests["long"])  # its 8 blocks fill the pool, 28 tokens to go
    assert s.hold("long") and not s.hold("long")  # a second hold finds no KV to drop
    assert s.requests["long"].status is RequestStatus.PREEMPTED and s.kv.pool.num_free == POOL
    s.add(short)
    out = _step(s)
    assert _chunks(out) == [("short", 0, 8, 0)]  # the others run; the held one is passed over
    while s.requests.get("short") is not None and s.requests["short"].num_output_tokens < 2:
        _step(s)
    s.finish("short", RequestStatus.FINISHED_LENGTH)
    assert _step(s).chunks == []  # held until released
    s.release("long")
    assert _chunks(_step(s))[0][0] == "long" and s.requests["long"].status is RequestStatus.RUNNING


def test_a_request_evicted_with_the_pool_full_of_its_blocks_comes_back_within_the_pool() -> None:
    """Its creditor was lost (``preempt_to_recompute``) with every block of the pool its own, cached: its prefix and
    next chunk exceed the pool. It comes back with all but the last cached block and computes that one; before, it
    waited for room no eviction could make, for good, and FCFS held every request behind it."""
    s = _scheduler()
    s.add(_long())
    _step(s)
    _step(s)
    assert s.preempt_to_recompute("long")
    assert s.requests["long"].num_computed_tokens == 0 and s.kv.pool.num_free == POOL
    out = _step(s)
    assert _chunks(out) == [("long", 28, 4, 0)]  # 7 cached blocks found again, the 8th computed
    assert s.requests["long"].status is RequestStatus.RUNNING and s.kv.num_allocated_blocks("long") == POOL
    assert s.requests["long"].num_computed_tokens == 32


def test_a_swapped_out_request_counts_its_blocks_on_creditors_as_theirs_at_swap_in() -> None:
    """With a host tier, a request with blocks on a creditor is swapped out for a more urgent one. Its swap-in needs
    room for its local blocks and the local part of its next chunk; counting its lent blocks as local it needed 15
    blocks of an 8-block pool and never came back."""
    # No prefix caching: the only moves between tiers are the swaps.
    s = _scheduler(host_blocks=POOL, policy=PLASPolicy(QueueConfig(base_s=1.0, growth=4.0)), caching=False)
    s.add(_long("L"))
    _step(s, service_s=2.0)  # 2 s of service: it drops below newcomers
    _step(s)
    s.kv.lend_leading_blocks("long", LentSpan("creditor", "m1", 6))
    _step(s)  # 48 tokens: 6 blocks on the creditor, 6 here
    s.add(Request("high", list(range(100, 112)), SamplingParams(max_tokens=2), 0.0, program=ProgramRef("H")))
    out = _step(s)
    assert [c.request_id for c in out.chunks] == ["high"]
    assert s.requests["long"].status is RequestStatus.SWAPPED and s.kv.num_swapped_blocks("long") == 6
    assert [(t.src.tier, t.dst.tier) for t in out.transfers] == [(DEVICE, HOST)] * 6
    s.finish("high", RequestStatus.FINISHED_STOPPED)
    out = _step(s)
    assert [(t.src.tier, t.dst.tier) for t in out.transfers] == [(HOST, DEVICE)] * 6
    # Back, still with its 6 blocks on the creditor; it computes what fits the pool (8 local blocks).
    assert _chunks(out) == [("long", 48, 8, 6)]
    assert s.requests["long"].status is RequestStatus.RUNNING and s.kv.num_lent_blocks("long") == 6


def test_a_request_whose_peak_needs_more_than_the_pool_starts_only_on_a_grant() -> None:
    """With the lending agent's ``grants_required``, a request whose prompt and ``max_tokens`` need more blocks than
    the pool waits, holding nothing, until the gManager's grant (cluster/lending_grants.py); others pass it."""
    s = _scheduler()
    s.grants_required = True
    long = _long()
    fits = Request("fits", list(range(100, 120)), SamplingParams(max_tokens=8), arrival_time=0.0)  # 7 blocks
    s.add(long)
    s.add(fits)
    assert s.awaiting_grant() == [("long", 16)]  # 60 + 4 tokens
    out = _step(s)
    assert [c.request_id for c in out.chunks] == ["fits"] and s.kv.num_allocated_blocks("long") == 0
    while s.requests["fits"].num_output_tokens < 8:
        assert [c.request_id for c in _step(s).chunks] == ["fits"]
    s.finish("fits", RequestStatus.FINISHED_LENGTH)
    assert _step(s).chunks == [] and s.awaiting_grant() == [("long", 16)]  # the pool free, it still waits
    assert not s.grant("nobody") and s.grant("long") and s.awaiting_grant() == []
    assert _chunks(_step(s)) == [("long", 0, BUDGET, 0)]
    # Dropped to recompute, it keeps its grant; finished, it is forgotten.
    s.preempt_to_recompute("long")
    assert s.awaiting_grant() == [] and "long" in s.granted
    s.finish("long", RequestStatus.FINISHED_ABORTED)
    assert s.granted == set()


def test_a_request_without_max_tokens_counts_its_prompt_only_and_none_waits_without_the_agent() -> None:
    s = _scheduler()
    s.grants_required = True
    uncapped = Request("u", list(range(28)), SamplingParams(max_tokens=None), arrival_time=0.0, max_model_len=64)
    s.add(uncapped)
    assert s.peak_blocks(uncapped) == 7 and s.awaiting_grant() == []  # 28 tokens; its growth is the plans' to lend
    plain = _scheduler()  # no lending agent: nothing waits for a grant
    plain.add(_long())
    assert plain.awaiting_grant() == [] and _chunks(_step(plain)) == [("long", 0, BUDGET, 0)]
