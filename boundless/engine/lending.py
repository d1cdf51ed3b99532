"""One instance's side of KV lending: its rManager, its DistAttention, and the effects of the move protocol.

:class:`LendingAgent` binds an :class:`~boundless.engine.core.EngineCore` to an
:class:`~boundless.cluster.rmanager.RManager` (the ledger and the protocol, pure) and to a transport:

- its runner's attention becomes :class:`~boundless.attention.dist_attention.DistributedAttention`, so a
  request whose leading blocks live on creditors gets their partials merged into each layer's attention;
- a :class:`~boundless.attention.partial_service.PartialServer` answers the debtors whose blocks it holds;
- it carries out the protocol's actions: a move's blocks go to the creditor over the transport (one message,
  every layer), the creditor writes them into pool blocks of its own outside any request, and only on its
  confirmation does the debtor free its copies and record the span (``KVCacheManager.lend_leading_blocks``);
  a release frees the creditor's blocks; remote blocks of a request its engine dropped (finished, aborted,
  preempted to recompute) are released.

The control messages between instances (try, answer, blocks sent, confirmation, release) go through a
:class:`ControlPlane`: the cluster carries them over Ray; :class:`LocalControlPlane` carries them between agents
of one process (tests, one-node benchmarks). Tensors (blocks, queries, partials) always go over the transport.
An agent's instance id is its transport address, so the ledger's debtor names the peer the server answers.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from boundless.attention.dist_attention import DistributedAttention
from boundless.attention.partial_service import PartialClient, PartialServer, RemotePartialError
from boundless.attention.remote_partials import LentBlocks
from boundless.cluster.lending_cluster import LendingOrder, OrderGrant, OrderHold, OrderMove, OrderRefuse
from boundless.cluster.placement import Heartbeat
from boundless.cluster.rmanager import (
    FreeLentBlocks,
    FreeLocalBlocks,
    LendingAction,
    LoanState,
    LocalRequest,
    LocalState,
    MoveRejected,
    Recompute,
    ReleaseRemote,
    RManager,
    SendBlocks,
    TryMove,
)
from boundless.engine.attention_time import HEARTBEAT_READER
from boundless.engine.core import GRANT_REFUSED, EngineCore, RequestDelta
from boundless.engine.executor import ModelExecutor
from boundless.engine.lending_stats import LendingStats
from boundless.engine.request import RequestStatus
from boundless.kv.manager import LentSpan
from boundless.transport.base import KVTransport, TransportError
from boundless.transport.blocks import BlocksReceive, send_blocks
from boundless.transport.endpoints import rank_address

_MOVE_TAG_BASE = 0xF200_0000
_MOVE_TAG_SPAN = 1 << 24


def move_tag(move_id: str) -> int:
    """The tag a move's blocks travel on: both sides derive it from the move id."""
    return _MOVE_TAG_BASE + zlib.crc32(move_id.encode()) % _MOVE_TAG_SPAN


@dataclass
class MoveStats:
    """Moves this instance made or took (cumulative)."""

    moves_out: int = 0
    blocks_out: int = 0
    bytes_out: int = 0
    moves_in: int = 0
    blocks_in: int = 0
    bytes_in: int = 0
    requests_recomputed: int = 0
    requests_held: int = 0
    requests_granted: int = 0
    requests_refused: int = 0


def next_chunk_needs(core: EngineCore, chunks: int = 1) -> list[tuple[str, int]]:
    """Each running request's id and the blocks it must add for its next ``chunks`` chunks (a step's budget of
    tokens each, or what is left of its context), in the scheduler's running order; its blocks on creditors count
    as held. Taken while a step runs, it counts from where that step leaves the request (its chunk's blocks are
    taken already)."""
    kv, sched = core.kv, core.scheduler
    return [
        (
            r.request_id,
            kv.blocks_for_tokens(min(r.num_tokens, sched.tokens_after_step(r) + chunks * sched.max_num_batched_tokens))
            - kv.num_allocated_blocks(r.request_id)
            - kv.first_local_block(r.request_id),
        )
        for r in sched.running
        if r.status is RequestStatus.RUNNING
    ]


def stalled_growth(needs: Sequence[tuple[str, int]], free: int) -> list[tuple[str, int]]:
    """The running requests that cannot grow: each of ``needs`` (id, blocks to add for its next chunk, in
    scheduling order) takes its blocks from the ``free`` ones while they last; those whose need no longer fits
    stall (the scheduler evicts them, or keeps one whose blocks fill the whole pool, ``engine/scheduler.py``). The
    planner sees them as waiting for that many blocks rather than as running, so a move that frees the room lets
    them run. Without this, a request whose context outgrows the pool while it is alone on its instance gains
    nothing in the model from a move, and never gets one."""
    stalled = []
    for request_id, need in needs:
        if need <= 0:
            continue
        if need <= free:
            free -= need
        else:
            stalled.append((request_id, need))
    return stalled


class BlockReceive(Protocol):
    """A creditor's posted receive of a move's blocks into ``block_ids`` of its pool."""

    block_ids: list[int]

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the blocks are written; raises :class:`TransportError` when they do not come."""
        ...

    def cancel(self) -> None:
        """Give the receive up: nothing is written into its blocks after."""
        ...


class BlockSend(Protocol):
    def wait(self, timeout_s: float | None = None) -> None: ...


@dataclass(frozen=True)
class PartialCounters:
    """DistAttention's work so far, as the agent's snapshot reports it."""

    round_trips: int = 0
    round_trip_bytes: int = 0
    partials_served: int = 0
    remote_layers: int = 0
    exposed_wait_s: float = 0.0


class LendingData(Protocol):
    """The tensors' side of an agent: a move's blocks between pools, and the partials over lent blocks. The
    agent's decisions and bookkeeping never depend on which one it has: :class:`TransportLendingData` (the real
    model runner, its KV cache and a transport) or the simulator's (``sim/lending.py``, virtual time)."""

    def send_blocks(self, creditor: str, tag: int, block_ids: Sequence[int]) -> BlockSend: ...

    def receive_blocks(self, debtor: str, tag: int, block_ids: Sequence[int], move_id: str) -> BlockReceive: ...

    def serve(self, debtor: str) -> None:
        """Answer ``debtor``'s partial requests from now on (it has blocks here)."""
        ...

    def counters(self) -> PartialCounters: ...

    def close(self) -> None: ...


class TransportLendingData:
    """Lending over a real transport: the runner's attention becomes DistributedAttention, a PartialServer
    answers debtors, blocks go as one message each (``transport/blocks.py``)."""

    def __init__(
        self,
        core: EngineCore,
        transport: KVTransport,
        lent_blocks: Callable[[str], LentBlocks | None],
        on_peer_lost: Callable[[str], None],
        timeout_s: float,
        agree: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``agree``: a split model's sum over its ranks, by which its DistAttention agrees on failed round trips
        (``SplitLendingData``)."""
        if not isinstance(core.executor, ModelExecutor):
            raise TypeError("KV lending needs the model executor")
        self.transport = transport
        runner = core.executor.runner
        self.cache = runner.kv_cache
        caches = [self.cache.layer(i) for i in range(self.cache.num_layers)]
        self.client = PartialClient(transport, timeout_s)
        self.attention = DistributedAttention(runner.attention, self.client, caches, agree)
        runner.attention = self.attention
        local = runner.attention.local
        self.server = PartialServer(
            transport, self.cache.layer, lent_blocks, local.scale, timeout_s, on_peer_lost, local.softcap
        )

    # (Peers by their instances' addresses; a split one's rank 0 is its first: ``transport/endpoints.py``.)
    def send_blocks(self, creditor: str, tag: int, block_ids: Sequence[int]) -> BlockSend:
        return send_blocks(self.transport, rank_address(creditor, 0), tag, self.cache, block_ids)

    def receive_blocks(self, debtor: str, tag: int, block_ids: Sequence[int], move_id: str) -> BlockReceive:
        return BlocksReceive(self.transport, rank_address(debtor, 0), tag, self.cache, block_ids)

    def serve(self, debtor: str) -> None:
        self.server.add_peer(rank_address(debtor, 0))

    def counters(self) -> PartialCounters:
        c, a = self.client.stats, self.attention.stats
        return PartialCounters(
            c.round_trips, c.bytes_sent + c.bytes_received, self.server.stats.round_trips, a.layers, a.exposed_s
        )

    def close(self) -> None:
        self.server.close()


class ControlPlane(Protocol):
    """Carries the protocol's control messages to another instance's agent and returns its answer.
    ``take_blocks`` answers with a receipt of the receive the creditor posted (the receive itself in one process,
    ``LocalControlPlane``; a token across processes, ``cluster/lending_instance.py``), or None;
    ``confirm_blocks`` hands that receipt back."""

    def try_move(self, creditor: str, action: TryMove) -> bool: ...

    def take_blocks(self, creditor: str, action: SendBlocks, debtor: str) -> Any: ...

    def confirm_blocks(self, creditor: str, move_id: str, receive: Any) -> bool: ...

    def release(self, creditor: str, move_id: str) -> None: ...


class LendingAgent:
    """KV lending for one engine (see the module). ``rmanager.instance_id`` must be ``transport.address``."""

    def __init__(
        self,
        core: EngineCore,
        rmanager: RManager,
        transport: KVTransport | None,
        control: ControlPlane,
        timeout_s: float = 30.0,
        data: LendingData | None = None,
        lookahead_chunks: int = 1,
        count_hosted: bool = False,
    ) -> None:
        """Over ``transport`` (the real runner's DistributedAttention and partial server), or over ``data``
        (another tensor side: the simulator's) when given. ``lookahead_chunks``: a running request counts as
        stalled when the blocks of that many next chunks do not fit (see ``observe``). ``count_hosted``: this
        engine's requests may fill its pool less the blocks it hosts for others (``Scheduler.hosted_blocks``): one
        that reaches that keeps its blocks and waits for room rather than being evicted. Off: measured on 6 December
        it spared a preemption on a creditor, but on the simulator's chat trace the request it kept waited for room
        its debtor's request waited for too, and the deadlock breaker dropped one to recompute where an eviction had
        swapped out to host memory (``docs/lending.md``, "A creditor's own requests")."""
        # (A split model's instance is known by its ranks' endpoints' addresses, rank 0's first: ``transport``'s.)
        if data is None and (transport is None or rank_address(rmanager.instance_id, 0) != transport.address):
            raise ValueError("an agent's instance id is its transport address (its ranks', a split model's)")
        self.core = core
        # Leading blocks move to creditors here, by block index: none goes back to the pool past a sliding window too
        # (``KVCacheManager.release_outside_window``; a move takes the first local blocks, lent blocks come first).
        core.kv.window = None
        self.rm = rmanager
        self.control = control
        self.timeout_s = timeout_s
        self.stats = MoveStats()
        self.lookahead_chunks = lookahead_chunks
        self.count_hosted = count_hosted
        self._lost_debtors: set[str] = set()  # seen gone by the server's thread; acted on by observe
        if data is None:
            assert transport is not None
            from boundless.engine.split_lending import SplitLendingData  # (its data builds on this module's)

            make = SplitLendingData if core.ranks is not None else TransportLendingData
            data = make(core, transport, self._lent_blocks, self._lost_debtors.add, timeout_s)
        self.data = data
        core.lending_stats = self.snapshot
        core.scheduler.grants_required = True  # a request longer than the pool starts on the gManager's grant
        self._refused: list[RequestDelta] = []
        # Creditor side: each move's receive posted by ``on_take_blocks``, its blocks set aside in the pool, until the
        # debtor confirms the move, releases it, or its reservation ends (expired, its debtor lost): see ``_abandon``.
        self._posted: dict[str, BlockReceive] = {}

    def snapshot(self) -> LendingStats:
        m, p = self.stats, self.data.counters()
        return LendingStats(
            moves_out=m.moves_out,
            blocks_out=m.blocks_out,
            bytes_out=m.bytes_out,
            moves_in=m.moves_in,
            blocks_in=m.blocks_in,
            bytes_in=m.bytes_in,
            requests_recomputed=m.requests_recomputed,
            requests_held=m.requests_held,
            requests_granted=m.requests_granted,
            requests_refused=m.requests_refused,
            round_trips=p.round_trips,
            round_trip_bytes=p.round_trip_bytes,
            partials_served=p.partials_served,
            remote_layers=p.remote_layers,
            exposed_wait_s=p.exposed_wait_s,
            blocks_lent=self.rm.lent_blocks,
            blocks_borrowed=sum(self.core.kv.num_lent_blocks(r.request_id) for r in self.core.scheduler.running),
        )

    @property
    def instance_id(self) -> str:
        return self.rm.instance_id

    def heartbeat(self) -> Heartbeat:
        """The rManager's report for the gManager, with the steps the engine ran since the last one (drained as
        the heartbeats' reader, so a calibration taking the same steps takes all of them too)."""
        return self.rm.heartbeat(self.core.step_times.drain(HEARTBEAT_READER))

    def close(self) -> None:
        self.data.close()

    def _lent_blocks(self, move_id: str) -> LentBlocks | None:
        """Called on the server's thread: a dict read, atomic under the interpreter lock."""
        loan = self.rm.loans.get(move_id)
        if loan is None or loan.state is not LoanState.FILLED:
            return None
        return LentBlocks(loan.block_ids)

    # -- the engine's view --------------------------------------------------------------------------------

    def observe(self) -> list[LendingAction]:
        """Tell the rManager the engine's state, and release the remote blocks of requests the engine dropped.
        Call between steps, or while one runs (a heartbeat): the state is then the one that step will leave."""
        kv, sched = self.core.kv, self.core.scheduler
        running = [r for r in sched.running if r.status is RequestStatus.RUNNING]
        requests = {
            r.request_id: LocalRequest(
                sched.tokens_after_step(r), kv.num_allocated_blocks(r.request_id), sched.waits_for_room(r)
            )
            for r in running
        }
        own = sum(req.local_blocks for req in requests.values())
        free = self.rm.total_blocks - own - self.rm.reserved_blocks - self.rm.lent_blocks
        # With plans made between the engine's steps (a benchmark) one chunk is enough; a plan from a heartbeat
        # reaches the debtor a step after the report, when the next chunk may already have stalled: looking
        # further ahead lends before the request stalls for want of room.
        needs = next_chunk_needs(self.core, self.lookahead_chunks)
        stalled = tuple(need for _, need in stalled_growth(needs, free))
        # Held back by the deadlock breaker, or awaiting a grant: they wait for no room (a held one's freed blocks are
        # for lending; one awaiting a grant starts when the gManager says, not when blocks are free).
        awaiting = sched.awaiting_grant()
        waiting_grant = {rid for rid, _ in awaiting}
        queued = [r for r in sched.waiting if r.request_id not in sched.held and r.request_id not in waiting_grant]
        self.rm.observe(
            LocalState(
                own_blocks=own,
                batch_size=len(running) - len(stalled),
                max_batch_size=self.core.config.scheduler.max_num_seqs,
                requests=requests,
                # A swapped-out request's blocks on creditors stay there: it needs room for the rest only.
                waiting_blocks=stalled
                + tuple(kv.blocks_for_tokens(r.num_tokens) - kv.num_lent_blocks(r.request_id) for r in queued),
                queued=tuple(r.request_id for r in queued),
                awaiting_grant=tuple(awaiting),
            )
        )
        actions: list[LendingAction] = []
        while self._lost_debtors:
            actions += self.rm.peer_lost(self._lost_debtors.pop())
        for request_id, _ in kv.take_dropped_lent():
            actions += self.rm.request_finished(request_id)
        self.apply(actions)
        for move_id in [m for m in self._posted if m not in self.rm.loans]:  # its reservation expired or was dropped
            self._abandon(self._posted.pop(move_id))
        self._count_hosted()
        return actions

    def _count_hosted(self) -> None:
        """With ``count_hosted``, tell the scheduler the blocks this instance holds for others (lent and reserved),
        which its own requests may not grow into (``Scheduler._local_limit``): called wherever the loans change."""
        if self.count_hosted:
            self.core.scheduler.hosted_blocks = self.rm.lent_blocks + self.rm.reserved_blocks

    def step(self) -> list[RequestDelta]:
        """One engine step, then :meth:`observe`. A step whose round trip to a creditor fails (it died, it timed
        out) is dropped as a failed step is (its chunks run again) and that creditor is taken as lost: the
        requests with blocks there are recomputed, so none fails and greedy output is unchanged."""
        core = self.core
        sched = core.schedule()
        deltas: list[RequestDelta] = core.take_rejected()  # (requests failed as the step was decided)
        if not sched.is_empty:
            try:
                result = core.execute(sched)
            except RemotePartialError as e:
                core.scheduler.step_failed(sched)  # names of the blocks it was writing are dropped
                self.round_trip_failed(e.creditor)
            else:
                deltas += core.finish_step(sched, result)
        self.observe()
        return deltas

    # -- the protocol ---------------------------------------------------------------------------------------

    def move_kvcache(self, request_id: str, num_blocks: int, creditor: str) -> bool:
        """The gManager's order: move up to ``num_blocks`` of the request's leading blocks to ``creditor``. Runs
        the protocol to its end (try, send, confirm, free); True when blocks moved."""
        self.observe()
        before = self.rm.counters.moves_committed
        self.apply(self.rm.move_kvcache(request_id, num_blocks, creditor))
        return self.rm.counters.moves_committed > before

    def carry_out(self, order: LendingOrder) -> bool:
        """A gManager order to this instance (a move, a hold, a release, a grant or a refusal): whether it changed
        anything. A refusal's final delta waits in :meth:`take_refused` for the loop to send."""
        if isinstance(order, OrderMove):
            return self.move_kvcache(order.request_id, order.num_blocks, order.creditor)
        if isinstance(order, OrderHold):
            return self.hold(order.request_id)
        if isinstance(order, OrderGrant):
            return self.grant(order.request_id)
        if isinstance(order, OrderRefuse):
            return self.refuse(order.request_id)
        return self.release(order.request_id)

    def apply(self, actions: list[LendingAction]) -> None:
        """Carry out the rManager's actions, and those they lead to."""
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            if isinstance(action, TryMove):
                accepted = self.control.try_move(action.creditor, action)
                queue += self.rm.try_answered(action.move_id, action.creditor, accepted)
            elif isinstance(action, SendBlocks):
                queue += self._send_blocks(action)
            elif isinstance(action, FreeLocalBlocks):
                self._free_local(action)
            elif isinstance(action, ReleaseRemote):
                self.control.release(action.creditor, action.move_id)
            elif isinstance(action, FreeLentBlocks):
                self.core.kv.free_unowned(action.block_ids)
            elif isinstance(action, Recompute):
                queue += self._recompute(action.request_id)
            elif isinstance(action, MoveRejected):
                pass  # the next plan decides again
        self._count_hosted()

    def _send_blocks(self, action: SendBlocks) -> list[LendingAction]:
        first_local = action.first_block - self.core.kv.num_lent_blocks(action.request_id)
        ids = self.core.kv.block_ids(action.request_id)[first_local : first_local + action.num_blocks]
        if first_local != 0 or len(ids) != action.num_blocks:
            return self.rm.move_done(action.move_id, action.creditor, False)
        receive = self.control.take_blocks(action.creditor, action, self.instance_id)
        if receive is None:
            return self.rm.move_done(action.move_id, action.creditor, False)
        try:
            self.data.send_blocks(action.creditor, move_tag(action.move_id), ids).wait(self.timeout_s)
        except TransportError:
            return self.rm.move_done(action.move_id, action.creditor, False)
        committed = self.control.confirm_blocks(action.creditor, action.move_id, receive)
        if committed:
            self.stats.moves_out += 1
            self.stats.blocks_out += len(ids)
            self.stats.bytes_out += len(ids) * self.core.block_bytes
        return self.rm.move_done(action.move_id, action.creditor, committed)

    def _free_local(self, action: FreeLocalBlocks) -> None:
        span = next(s for s in self.rm.remote_spans(action.request_id) if s.first_block == action.first_block)
        self.core.kv.lend_leading_blocks(action.request_id, LentSpan(span.creditor, span.move_id, span.num_blocks))

    def _recompute(self, request_id: str, hold: bool = False) -> list[LendingAction]:
        """Blocks of the request were lost with their creditor (or the deadlock breaker ``hold`` s it): drop its KV
        and compute it again from its tokens (prompt and output so far), as a preemption to recompute does; greedy
        output is unchanged. Its blocks on other creditors are released (the recompute makes them anew here)."""
        sched = self.core.scheduler
        if not (sched.hold(request_id) if hold else sched.preempt_to_recompute(request_id)):
            return []
        if hold:
            self.stats.requests_held += 1
        else:
            self.stats.requests_recomputed += 1
        self.core.kv.take_dropped_lent(request_id)
        return self.rm.request_finished(request_id)

    def hold(self, request_id: str) -> bool:
        """The gManager's deadlock breaker (``cluster/lending_deadlock.py``): drop the request's KV to recompute it
        later, release its blocks on creditors, and admit it no more until :meth:`release`. Only while it still waits
        for room (the order was planned from a heartbeat); False, and nothing done, otherwise."""
        sched = self.core.scheduler
        request = sched.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING or not sched.waits_for_room(request):
            return False
        self.apply(self._recompute(request_id, hold=True))
        return True

    def grant(self, request_id: str) -> bool:
        """The gManager's grant (``cluster/lending_grants.py``): the request, longer than the pool, may start (False:
        it is not here any more)."""
        if not self.core.scheduler.grant(request_id):
            return False
        self.stats.requests_granted += 1
        return True

    def refuse(self, request_id: str) -> bool:
        """The gManager's refusal (``cluster/lending_grants.py``): the request, still awaiting its grant, is failed
        with :data:`GRANT_REFUSED`; its final delta is kept for :meth:`take_refused` (False, and nothing done: it
        is not here, or it started meanwhile)."""
        sched = self.core.scheduler
        request = sched.requests.get(request_id)
        if request is None or not sched.awaits_grant(request) or not self.core.abort(request_id):
            return False
        self.stats.requests_refused += 1
        self._refused.append(
            RequestDelta(request_id, [], "", [], finished=True, finish_reason="error", stop_reason=GRANT_REFUSED)
        )
        return True

    def take_refused(self) -> list[RequestDelta]:
        """The final deltas of the requests refused since the last call, for the engine loop to send."""
        out, self._refused = self._refused, []
        return out

    def release(self, request_id: str) -> bool:
        """The gManager's release of a held request: it may be admitted again (False: it was not held here)."""
        return self.core.scheduler.release(request_id)

    def peer_lost(self, instance_id: str) -> None:
        """Another instance died (the cluster's heartbeat timeout): free what was lent to it, recompute what it held."""
        self.apply(self.rm.peer_lost(instance_id))

    def peer_back(self, instance_id: str) -> None:
        """Another instance, lost before, was started again in its place: it may lend and borrow again."""
        self.rm.peer_back(instance_id)

    def round_trip_failed(self, creditor: str) -> None:
        """A step's round trip to ``creditor`` failed: it is taken as lost, as :meth:`peer_lost`, unless no block is
        held there any more. Then the cluster's ``PeerLost`` came first (a Ray instance runs it mid-step: the loop
        holds its lock only between steps) and the requests are recomputed already; and a round trip waits up to its
        timeout, so the creditor may be restarted at the same address by now (``PeerBack``): taken as lost again,
        it would be refused as a creditor and a debtor for good, and what it borrowed since freed under it."""
        if any(span.creditor == creditor for spans in self.rm.spans.values() for span in spans):
            self.peer_lost(creditor)

    # -- the creditor's side (called through the control plane) ---------------------------------------------

    def on_try_move(self, action: TryMove) -> bool:
        self.observe()
        accepted = self.rm.try_move_kvcache(action.move_id, action.request_id, action.debtor, action.num_blocks)
        self._count_hosted()
        return accepted

    def on_take_blocks(self, action: SendBlocks, debtor: str) -> BlockReceive | None:
        """Reserve pool blocks for a move's blocks and post their receive."""
        loan = self.rm.loans.get(action.move_id)
        if loan is None or loan.state is not LoanState.RESERVED:
            return None
        ids = self.core.kv.allocate_unowned(action.num_blocks)
        if ids is None:
            return None
        receive = self._posted[action.move_id] = self.data.receive_blocks(
            debtor, move_tag(action.move_id), ids, action.move_id
        )
        return receive

    def posted(self, move_id: str) -> BlockReceive | None:
        """The receive ``on_take_blocks`` posted for the move, until it is confirmed or abandoned."""
        return self._posted.get(move_id)

    def on_confirm_blocks(self, move_id: str, receive: BlockReceive) -> bool:
        if self._posted.pop(move_id, None) is not receive:  # abandoned meanwhile: its blocks are free again
            return False
        loan = self.rm.loans.get(move_id)
        try:
            receive.wait(self.timeout_s)
        except TransportError:
            self.core.kv.free_unowned(receive.block_ids)
            return False
        if not self.rm.receive_blocks(move_id, receive.block_ids):
            self.core.kv.free_unowned(receive.block_ids)
            self._count_hosted()
            return False
        self._count_hosted()
        assert loan is not None
        self.data.serve(loan.debtor)
        self.stats.moves_in += 1
        self.stats.blocks_in += len(receive.block_ids)
        self.stats.bytes_in += len(receive.block_ids) * self.core.block_bytes
        return True

    def on_release(self, move_id: str) -> None:
        receive = self._posted.pop(move_id, None)
        self.apply(self.rm.release(move_id))
        if receive is not None:  # taken, never confirmed: the debtor gave the move up (its answer lost, a send failed)
            self._abandon(receive)

    def _abandon(self, receive: BlockReceive) -> None:
        """A move's receive that no confirmation will take: cancelled (nothing is written after) and its blocks freed.
        Kept, a move whose answer to the debtor was lost held its blocks, its staging tensor and its posted receive
        for good."""
        receive.cancel()
        self.core.kv.free_unowned(receive.block_ids)


class LocalControlPlane:
    """Control messages between the agents of one process, as plain calls (the cluster's are Ray calls)."""

    def __init__(self) -> None:
        self.agents: dict[str, LendingAgent] = {}
        self.down: set[str] = set()  # instances that died: nothing reaches them

    def add(self, agent: LendingAgent) -> LendingAgent:
        self.agents[agent.instance_id] = agent
        return agent

    def try_move(self, creditor: str, action: TryMove) -> bool:
        return creditor not in self.down and self.agents[creditor].on_try_move(action)

    def take_blocks(self, creditor: str, action: SendBlocks, debtor: str) -> BlockReceive | None:
        return None if creditor in self.down else self.agents[creditor].on_take_blocks(action, debtor)

    def confirm_blocks(self, creditor: str, move_id: str, receive: BlockReceive) -> bool:
        return creditor not in self.down and self.agents[creditor].on_confirm_blocks(move_id, receive)

    def release(self, creditor: str, move_id: str) -> None:
        if creditor not in self.down:
            self.agents[creditor].on_release(move_id)
