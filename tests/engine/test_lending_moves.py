"""KV moves between engines for real (over a shared-memory transport), and their faults.

After a move, a refused move and a move interrupted halfway, each block on each side holds its own tokens' KV
(the KV-integrity idea across instances: compared with one engine computing the same request in lockstep), the
ledgers agree with the pools, and decoding goes on with one engine's output. A creditor that dies has its
requests' blocks recomputed (same output); a debtor that dies has its blocks freed by its creditors."""

from __future__ import annotations

import time

import pytest
import torch
from lending_helpers import BLOCK, CHUNK, LONG, PARAMS, Cluster, LocalControlPlane, Recorded, engine, reference

from boundless.api.metrics import ServerMetrics
from boundless.cluster.rmanager import SendBlocks
from boundless.engine.core import EngineCore
from boundless.engine.lending import LendingAgent, stalled_growth
from boundless.transport.blocks import BlocksReceive


class Lockstep:
    """The debtor's request and the same request on an engine of its own, stepped together."""

    def __init__(self, cluster: Cluster, loaded, kv_cache_dtype: str = "auto") -> None:
        self.cluster = cluster
        self.ref = engine(loaded, kv_cache_dtype=kv_cache_dtype)
        self.ref.add_request("long", LONG, PARAMS)
        cluster.agents[0].core.add_request("long", LONG, PARAMS)
        self.tokens: list[int] = []

    def step(self) -> None:
        for delta in self.cluster.agents[0].step():
            self.tokens += delta.new_token_ids
        for agent in self.cluster.agents[1:]:
            agent.step()
        self.ref.step()

    def computed(self) -> int:
        return self.cluster.agents[0].core.scheduler.requests["long"].num_computed_tokens


def _kv(core: EngineCore, block_id: int) -> torch.Tensor:
    return core.executor.runner.kv_cache.read_blocks([block_id])


def _assert_same_kv(got: torch.Tensor, want: torch.Tensor) -> None:
    """Blocks of the same tokens: to 1e-4, or in an 8-bit cache to the bit (the values were rounded alike)."""
    if got.element_size() == 1:
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def assert_blocks_hold_their_tokens(cluster: Cluster, ref: EngineCore) -> None:
    """Every computed full block of the request, local or lent, holds the KV the lockstep engine has for it."""
    debtor = cluster.agents[0]
    by_id = {a.instance_id: a for a in cluster.agents}
    ref_ids = ref.kv.block_ids("long")
    full = debtor.core.scheduler.requests["long"].num_computed_tokens // BLOCK
    first = debtor.core.kv.num_lent_blocks("long")
    for i, block in enumerate(debtor.core.kv.block_ids("long")[: full - first]):
        _assert_same_kv(_kv(debtor.core, block), _kv(ref, ref_ids[first + i]))
    lent = 0
    for span in debtor.rm.remote_spans("long"):
        creditor = by_id[span.creditor]
        loan = creditor.rm.loans[span.move_id]
        assert len(loan.block_ids) == span.num_blocks
        for j, block in enumerate(loan.block_ids):
            _assert_same_kv(_kv(creditor.core, block), _kv(ref, ref_ids[span.first_block + j]))
        lent += span.num_blocks
    assert lent == first
    # Each creditor's pool holds exactly the blocks it lends.
    for creditor in cluster.agents[1:]:
        assert creditor.core.kv.pool.num_used == creditor.rm.lent_blocks


def _finish(run: Lockstep, steps: int = 200) -> None:
    for _ in range(steps):
        if not run.cluster.agents[0].core.has_unfinished():
            return
        run.step()
    raise AssertionError("not finished")


def _two_chunks_in(cluster: Cluster, loaded, kv: str = "auto") -> tuple[Cluster, Lockstep]:
    """``cluster`` run in lockstep until its long request has two chunks computed (blocks to move)."""
    run = Lockstep(cluster, loaded, kv)
    while run.computed() < 2 * CHUNK:
        run.step()
    return cluster, run


# With an 8-bit KV cache too: the blocks move as their bytes, lent ones hold the debtor's to the bit.
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_moves_keep_every_block_its_own_and_the_output_unchanged(load, make_cluster, kv: str) -> None:
    loaded = load("tiny-llama")
    want = reference(loaded, {"long": LONG}, kv_cache_dtype=kv)
    cluster, run = _two_chunks_in(make_cluster(loaded, 3, kv_cache_dtype=kv), loaded, kv)
    debtor, c1, c2 = cluster.agents
    assert debtor.move_kvcache("long", 3, c1.instance_id)
    assert_blocks_hold_their_tokens(cluster, run.ref)
    assert debtor.core.kv.num_lent_blocks("long") == 3 and c1.core.kv.pool.num_used == 3
    while run.computed() < len(LONG) + 3:
        run.step()
    assert debtor.move_kvcache("long", 2, c2.instance_id)  # blocks computed with remote attention move on
    assert_blocks_hold_their_tokens(cluster, run.ref)
    run.step()
    assert_blocks_hold_their_tokens(cluster, run.ref)
    _finish(run)
    assert run.tokens == want.tokens["long"]
    # Bytes moved: 5 blocks of [layers, 2, kv_heads, block, head_dim] in the cache's type (fp32: 4 bytes, fp8: 1).
    data = debtor.data.cache.data
    per_block = data[:, :, :, 0].numel() * data.element_size()
    assert debtor.stats.bytes_out == 5 * per_block
    assert c1.rm.lent_blocks == 0 and c2.rm.lent_blocks == 0 and c1.core.kv.pool.num_used == 0
    # /metrics: moves and bytes by direction, and the round trips on each side.
    text = ServerMetrics(lambda: {"d": debtor.core.stats(), "c1": c1.core.stats(), "c2": c2.core.stats()}).render()
    lines = set(text.decode().splitlines())
    assert 'boundless_kv_lending_moves_total{direction="out",instance="d"} 2.0' in lines
    assert f'boundless_kv_lending_bytes_moved_total{{direction="in",instance="c1"}} {3 * per_block:.1f}' in lines
    served = c1.data.server.stats.round_trips + c2.data.server.stats.round_trips
    assert served == debtor.data.client.stats.round_trips > 0
    assert f'boundless_distattn_round_trips_total{{instance="d"}} {float(served)}' in lines
    # The engine records, with each step, the tokens it attended on creditors (simulate calibrate keeps those steps
    # out of its step model): none before the first move, 3 blocks' worth after it, 5 after the second.
    remote = [sample.remote for sample in debtor.core.step_times.drain()]
    assert remote[0] == 0 and 3 * 16 in remote and 5 * 16 in remote and set(remote) <= {0, 3 * 16, 5 * 16}


def test_a_refused_move_changes_nothing(load, make_cluster) -> None:
    loaded = load("tiny-llama")
    cluster, run = _two_chunks_in(make_cluster(loaded, 2), loaded)
    debtor, creditor = cluster.agents
    before = debtor.core.kv.block_ids("long")
    creditor.rm.headroom_blocks = creditor.rm.total_blocks  # no room to lend
    assert not debtor.move_kvcache("long", 2, creditor.instance_id)
    assert debtor.rm.counters.moves_refused == 1 and not debtor.rm.pending
    assert debtor.core.kv.block_ids("long") == before and debtor.core.kv.num_lent_blocks("long") == 0
    assert not creditor.rm.loans and creditor.core.kv.pool.num_used == 0
    assert_blocks_hold_their_tokens(cluster, run.ref)
    creditor.rm.headroom_blocks = 0  # the next plan's try succeeds
    assert debtor.move_kvcache("long", 2, creditor.instance_id)
    assert_blocks_hold_their_tokens(cluster, run.ref)


class LosesConfirmations(LocalControlPlane):
    """The creditor takes the blocks, but its confirmation never reaches the debtor."""

    def confirm_blocks(self, creditor: str, move_id: str, receive: BlocksReceive) -> bool:
        super().confirm_blocks(creditor, move_id, receive)
        return False


class CreditorDiesAfterTry(LocalControlPlane):
    """The creditor reserves, then dies before the blocks come."""

    def take_blocks(self, creditor: str, action: SendBlocks, debtor: str) -> BlocksReceive | None:
        self.down.add(creditor)
        return None


def _rewire(cluster: Cluster, control: LocalControlPlane) -> None:
    for agent in cluster.agents:
        agent.control = control
        control.add(agent)
    cluster.control = control


def test_a_move_interrupted_halfway_leaves_both_sides_consistent(load, make_cluster) -> None:
    loaded = load("tiny-llama")
    want = reference(loaded, {"long": LONG})
    now = [0.0]
    cluster, run = _two_chunks_in(make_cluster(loaded, 2, clock=lambda: now[0]), loaded)
    debtor, creditor = cluster.agents
    before = debtor.core.kv.block_ids("long")
    # The blocks arrive but the answer is lost: the debtor keeps its copies and releases the creditor's.
    _rewire(cluster, LosesConfirmations())
    assert not debtor.move_kvcache("long", 2, creditor.instance_id)
    assert debtor.core.kv.block_ids("long") == before and debtor.rm.counters.moves_failed == 1
    assert not creditor.rm.loans and creditor.core.kv.pool.num_used == 0
    assert_blocks_hold_their_tokens(cluster, run.ref)
    # The creditor reserves and dies before the blocks come: the debtor keeps its blocks; the reservation expires.
    _rewire(cluster, CreditorDiesAfterTry())
    assert not debtor.move_kvcache("long", 2, creditor.instance_id)
    assert debtor.core.kv.block_ids("long") == before and creditor.rm.reserved_blocks == 2
    now[0] += 31  # past the reservation timeout
    creditor.rm.expire()
    assert creditor.rm.reserved_blocks == 0 and creditor.rm.counters.reservations_expired == 1
    assert_blocks_hold_their_tokens(cluster, run.ref)
    _rewire(cluster, LocalControlPlane())
    _finish(run)
    assert run.tokens == want.tokens["long"]


class TakeAnswerLost(LocalControlPlane):
    """The creditor takes the move (its blocks set aside, their receive posted), but its yes never reaches the
    debtor: a Ray call that timed out while the creditor's loop held its lock through a long step. ``lose_release``:
    the debtor's release is lost too."""

    def __init__(self, lose_release: bool = False) -> None:
        super().__init__()
        self.lose_release = lose_release

    def take_blocks(self, creditor: str, action: SendBlocks, debtor: str) -> BlocksReceive | None:
        super().take_blocks(creditor, action, debtor)
        return None

    def release(self, creditor: str, move_id: str) -> None:
        if not self.lose_release:
            super().release(creditor, move_id)


def test_a_move_whose_take_answer_is_lost_frees_the_creditors_blocks(load, make_cluster) -> None:
    """Each move the debtor gave up after the creditor took it left the creditor's blocks set aside, with a staging
    tensor of their KV and a posted receive, for good: after three, six of its 40 blocks. The release frees them, and
    without one (lost too) the reservation's expiry does."""
    loaded = load("tiny-llama")
    now = [0.0]
    cluster, run = _two_chunks_in(make_cluster(loaded, 2, clock=lambda: now[0]), loaded)
    debtor, creditor = cluster.agents
    before = debtor.core.kv.block_ids("long")
    _rewire(cluster, TakeAnswerLost())
    for attempt in range(3):
        assert not debtor.move_kvcache("long", 2, creditor.instance_id)
        assert debtor.core.kv.block_ids("long") == before and debtor.rm.counters.moves_failed == attempt + 1
        assert not creditor.rm.loans and creditor.core.kv.pool.num_used == 0
        assert creditor.posted(f"{debtor.instance_id}/{attempt}") is None
    # The release lost as well: the creditor's reservation expires, and its blocks with it.
    _rewire(cluster, TakeAnswerLost(lose_release=True))
    assert not debtor.move_kvcache("long", 2, creditor.instance_id)
    assert creditor.rm.reserved_blocks == 2 and creditor.core.kv.pool.num_used == 2
    now[0] += 31  # past the reservation timeout
    creditor.rm.expire()
    creditor.observe()
    assert creditor.rm.reserved_blocks == 0 and creditor.core.kv.pool.num_used == 0
    assert_blocks_hold_their_tokens(cluster, run.ref)
    _rewire(cluster, LocalControlPlane())
    assert debtor.move_kvcache("long", 2, creditor.instance_id)  # the creditor lends those blocks again
    assert_blocks_hold_their_tokens(cluster, run.ref)


def _compute_two_chunks(debtor: LendingAgent, rec: Recorded) -> None:
    """The long request's first two chunks on ``debtor``, its deltas in ``rec``: blocks a move may take."""
    while debtor.core.scheduler.requests["long"].num_computed_tokens < 2 * CHUNK:
        for d in debtor.step():
            rec.add(d)


def test_a_creditor_that_dies_has_its_blocks_recomputed_with_identical_output(load, make_cluster) -> None:
    loaded = load("tiny-qwen2")
    want = reference(loaded, {"long": LONG})
    cluster = make_cluster(loaded, 3)
    debtor, c1, c2 = cluster.agents
    debtor.core.add_request("long", LONG, PARAMS)
    rec = Recorded()
    _compute_two_chunks(debtor, rec)
    assert debtor.move_kvcache("long", 2, c1.instance_id)
    assert debtor.move_kvcache("long", 1, c2.instance_id)
    while len(rec.tokens.get("long", [])) < 3:
        for d in debtor.step():
            rec.add(d)
        c2.step()
    # c1 dies without a word: the next round trip to it fails, its blocks are recomputed here, c2's released.
    cluster.kill(1)
    while debtor.core.has_unfinished():
        for d in debtor.step():
            rec.add(d)
        c2.step()
    assert rec.tokens["long"] == want.tokens["long"]
    assert debtor.stats.requests_recomputed == 1 and debtor.core.kv.num_lent_blocks("long") == 0
    assert not c2.rm.loans and c2.core.kv.pool.num_used == 0


def test_a_creditor_back_before_the_round_trip_to_it_fails_is_not_taken_as_lost_again(load, make_cluster) -> None:
    """A Ray instance hears the cluster's PeerLost mid-step (its loop holds its lock only between steps), and the
    step's round trip to the dead creditor fails later, at its timeout, when the creditor may be restarted at the
    same address already (PeerBack). Before, that failure took the creditor as lost again, for good: the debtor
    refused it as a creditor and a debtor from then on (found by the simulator, ``tests/sim/test_lending_sim.py``)."""
    loaded = load("tiny-qwen2")
    want = reference(loaded, {"long": LONG})
    cluster = make_cluster(loaded, 2)
    debtor, creditor = cluster.agents
    debtor.core.add_request("long", LONG, PARAMS)
    rec = Recorded()
    _compute_two_chunks(debtor, rec)
    assert debtor.move_kvcache("long", 2, creditor.instance_id)
    cluster.kill(1)
    execute = debtor.core.execute

    def told_meanwhile(sched):  # the cluster's word while the step's round trip is under way
        debtor.core.execute = execute  # type: ignore[method-assign]
        debtor.peer_lost(creditor.instance_id)
        debtor.peer_back(creditor.instance_id)
        return execute(sched)

    debtor.core.execute = told_meanwhile  # type: ignore[method-assign]
    for d in debtor.step():  # its round trip to the creditor fails
        rec.add(d)
    assert debtor.stats.requests_recomputed == 1 and debtor.core.kv.num_lent_blocks("long") == 0
    assert creditor.instance_id not in debtor.rm.lost_peers
    while debtor.core.has_unfinished():
        for d in debtor.step():
            rec.add(d)
    assert rec.tokens["long"] == want.tokens["long"]


def test_a_debtor_that_dies_has_its_blocks_freed_by_its_creditor(load, make_cluster) -> None:
    loaded = load("tiny-llama")
    cluster = make_cluster(loaded, 2)
    debtor, creditor = cluster.agents
    debtor.core.add_request("long", LONG, PARAMS)
    while debtor.core.scheduler.requests["long"].num_computed_tokens < 2 * CHUNK:
        debtor.step()
    assert debtor.move_kvcache("long", 3, creditor.instance_id)
    debtor.step()
    assert creditor.core.kv.pool.num_used == 3
    debtor.close()
    cluster.nets[0].close()  # the debtor's process is gone: its connections close
    deadline = time.monotonic() + 5
    while creditor.core.kv.pool.num_used and time.monotonic() < deadline:
        creditor.step()
        time.sleep(0.01)
    assert creditor.core.kv.pool.num_used == 0 and not creditor.rm.loans
    assert debtor.instance_id in creditor.rm.lost_peers


def test_a_request_that_cannot_grow_counts_as_waiting_for_the_blocks_it_needs() -> None:
    """The planner's view of running requests whose next chunk does not fit: they wait for that many blocks (a
    move that frees them lets them run), in scheduling order, after those ahead have taken theirs."""
    assert stalled_growth([("a", 2), ("b", 0), ("c", 1)], free=3) == []
    assert stalled_growth([("a", 4), ("b", 1)], free=3) == [("a", 4)]  # a cannot grow; b still fits
    assert stalled_growth([("a", 2), ("b", 2), ("c", 1)], free=3) == [("b", 2)]
    assert stalled_growth([("a", 16)], free=0) == [("a", 16)]


HUGE = [(17 * j) % 300 + 6 for j in range(70 * BLOCK + 4)]  # 70 full blocks and 4 tokens: 1.75 pools of 40


def test_a_request_longer_than_its_pool_waits_for_moves_and_survives_a_lost_creditor(load, make_cluster) -> None:
    """The pool full of its blocks, the request keeps them until a move makes room (evicting it would bring it back
    to the same wall). Its creditor lost right after a move, it is recomputed with every block of the pool still
    cached: prefix and next chunk exceed the pool, so it comes back with all but the last cached block (before, it
    was never admitted again). A move to another creditor then lets it finish, with one engine's output."""
    loaded = load("tiny-llama")
    want = reference(loaded, {"huge": HUGE}, num_blocks=80)
    cluster = make_cluster(loaded, 3, max_model_len=80 * BLOCK)
    debtor, c1, c2 = cluster.agents
    core = debtor.core
    pool = core.kv.pool.num_blocks
    core.add_request("huge", HUGE, PARAMS)
    assert core.scheduler.awaiting_grant() == [("huge", 71)]  # longer than the pool: it starts on a grant
    core.scheduler.grant("huge")  # the gManager's (cluster/lending_grants.py)
    request = core.scheduler.requests["huge"]
    rec = Recorded()

    def step() -> None:
        for d in debtor.step():
            rec.add(d)

    while request.num_computed_tokens < pool * BLOCK:
        step()
    step()  # the pool is full of its blocks: it waits, keeping them
    assert request.num_computed_tokens == pool * BLOCK and core.scheduler.stats.num_preemptions == 0
    assert debtor.move_kvcache("huge", 10, c1.instance_id)
    cluster.control.down.add(c1.instance_id)
    debtor.peer_lost(c1.instance_id)  # the cluster's heartbeat timeout: its blocks are recomputed here
    assert debtor.stats.requests_recomputed == 1 and request.num_computed_tokens == 0
    out = core.scheduler.schedule()
    assert [(c.start_pos, len(c.token_ids)) for c in out.chunks] == [((pool - 1) * BLOCK, BLOCK)]
    core.finish_step(out, core.execute(out))
    assert request.num_computed_tokens == pool * BLOCK
    assert debtor.move_kvcache("huge", 35, c2.instance_id)
    for _ in range(100):
        if not core.has_unfinished():
            break
        step()
        c2.step()
    assert rec.tokens["huge"] == want.tokens["huge"]
    assert c2.core.kv.pool.num_used == 0 and not c2.rm.loans
