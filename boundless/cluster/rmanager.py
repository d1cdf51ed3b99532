"""One instance's ledger of KV lending (Infinite-LLM's rManager) and the move protocol, as a state machine.

An instance is a *debtor* for its requests whose blocks it moved to other instances, and a *creditor* for the
blocks it holds for other instances' requests; it can be both. Its :class:`RManager` knows:

- which blocks are its own (how many its requests hold, as its engine reports with :meth:`RManager.observe`);
- which it has promised or lent, per move: request, debtor, count, reserved or filled (:class:`Loan`);
- which of its requests' blocks live on which creditor (:class:`RemoteSpan`: a range of the request's blocks).

A move follows the paper's protocol. The gManager tells the debtor ``move_kvcache(req, n, creditor)``; the
debtor asks the creditor ``try_move_kvcache``, which reserves ``n`` blocks first come, first served, or refuses
when it lacks room (the gManager's view may be a heartbeat old). On a yes the debtor sends the blocks; the
creditor writes them into blocks of its own and confirms; only then does the debtor free its copies. So a crash
anywhere loses no KV: until the confirmation the debtor still holds the blocks. A reservation that no data
fills expires after ``reservation_timeout_s`` on the injected clock, and a debtor's move that gets no answer
is given up after the same time, so a crash between the two steps leaks no reservation. Every release is
idempotent and a positive answer about a move the debtor no longer tracks is answered with a release, so
messages that cross (a request finishing while its move is under way) leave both sides consistent.

Nothing here does I/O or reads the time itself: methods take what happened and return :data:`LendingAction`
values for the transport and the engine to carry out (ask a creditor, send blocks, free blocks, recompute).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from boundless.cluster.placement import Heartbeat, InstanceReport, RequestReport
from boundless.engine.attention_time import AttentionSample

# -- what the engine tells its rManager ---------------------------------------------------------------------


@dataclass(frozen=True)
class LocalRequest:
    """A running request as its engine holds it: its context, and the blocks of it held here. ``waits_for_room``:
    its local blocks fill the whole pool and it has more to compute (``Scheduler.waits_for_room``)."""

    num_tokens: int
    local_blocks: int
    waits_for_room: bool = False


@dataclass(frozen=True)
class LocalState:
    """The instance's own use of its KV pool, as its engine sees it.

    ``own_blocks`` counts the blocks its own requests hold, not those it holds for debtors (the rManager keeps
    those); ``waiting_blocks`` gives the blocks each waiting request needs, in admission order; ``queued`` names
    the waiting requests (not those the deadlock breaker holds back, nor those awaiting a grant);
    ``awaiting_grant`` the requests longer than the pool that wait for the gManager's grant, with their peak blocks.
    """

    own_blocks: int
    batch_size: int
    max_batch_size: int
    requests: Mapping[str, LocalRequest] = field(default_factory=dict)
    waiting_blocks: tuple[int, ...] = ()
    queued: tuple[str, ...] = ()
    awaiting_grant: tuple[tuple[str, int], ...] = ()


# -- the ledger ---------------------------------------------------------------------------------------------


class LoanState(Enum):
    RESERVED = "reserved"  # promised by try_move_kvcache, not yet filled
    FILLED = "filled"  # the debtor's blocks are here


@dataclass
class Loan:
    """Blocks a creditor holds (or has promised) for one move of a debtor's request."""

    move_id: str
    request_id: str
    debtor: str
    num_blocks: int
    state: LoanState
    expires_at: float  # a reservation not filled by then is dropped
    block_ids: tuple[int, ...] = ()  # the creditor's pool blocks, once filled


@dataclass(frozen=True)
class RemoteSpan:
    """Blocks ``[first_block, first_block + num_blocks)`` of a request, held by ``creditor`` under ``move_id``."""

    move_id: str
    creditor: str
    first_block: int
    num_blocks: int


class MoveState(Enum):
    TRYING = "trying"  # try_move_kvcache asked, no answer yet
    SENDING = "sending"  # reserved on the creditor; the blocks are on their way


@dataclass
class PendingMove:
    """A debtor's move under way; its blocks stay local until the creditor confirms."""

    move_id: str
    request_id: str
    creditor: str
    first_block: int
    num_blocks: int
    state: MoveState
    started_at: float


# -- what it asks the transport and the engine to do --------------------------------------------------------


@dataclass(frozen=True)
class TryMove:
    """Debtor → creditor: call ``try_move_kvcache`` there and feed the answer to :meth:`RManager.try_answered`."""

    creditor: str
    move_id: str
    request_id: str
    debtor: str
    num_blocks: int


@dataclass(frozen=True)
class SendBlocks:
    """Debtor → creditor: send these blocks of the request; the creditor writes them into blocks of its own and
    calls :meth:`RManager.receive_blocks`, whose answer goes to the debtor's :meth:`RManager.move_done`."""

    creditor: str
    move_id: str
    request_id: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class FreeLocalBlocks:
    """Debtor's engine: these blocks of the request now live on a creditor; free the local copies."""

    request_id: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class ReleaseRemote:
    """Debtor → creditor: call :meth:`RManager.release` for this move there (idempotent)."""

    creditor: str
    move_id: str


@dataclass(frozen=True)
class FreeLentBlocks:
    """Creditor's engine: these pool blocks held a debtor's KV that nobody needs any more; free them."""

    debtor: str
    move_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Recompute:
    """Debtor's engine: these blocks of the request were lost with their creditor; compute them again."""

    request_id: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class MoveRejected:
    """The debtor did not start a move the gManager asked for (for logs and counters)."""

    request_id: str
    creditor: str
    reason: str


LendingAction = TryMove | SendBlocks | FreeLocalBlocks | ReleaseRemote | FreeLentBlocks | Recompute | MoveRejected


@dataclass
class LendingCounters:
    """What one instance's lending did so far (cumulative)."""

    moves_started: int = 0  # try_move_kvcache asked
    moves_refused: int = 0  # ... and refused
    moves_committed: int = 0  # blocks confirmed on the creditor
    moves_failed: int = 0  # given up after a yes: data refused, lost or late
    blocks_moved_out: int = 0
    blocks_received: int = 0
    reservations_expired: int = 0
    blocks_recomputed: int = 0  # lost with a creditor


class RManager:
    """The lending ledger and protocol of one instance (see the module).

    ``headroom_blocks`` are kept free for the instance's own requests to grow into: a reservation that would
    eat into them is refused.
    """

    def __init__(
        self,
        instance_id: str,
        total_blocks: int,
        block_size: int,
        clock: Callable[[], float],
        reservation_timeout_s: float,
        headroom_blocks: int = 0,
    ) -> None:
        if reservation_timeout_s <= 0:
            raise ValueError("reservation_timeout_s must be positive")
        self.instance_id = instance_id
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.clock = clock
        self.reservation_timeout_s = reservation_timeout_s
        self.headroom_blocks = headroom_blocks
        self.local = LocalState(own_blocks=0, batch_size=0, max_batch_size=0)
        self._requests: dict[str, LocalRequest] = {}
        self.loans: dict[str, Loan] = {}  # creditor side, by move id
        self.spans: dict[str, list[RemoteSpan]] = {}  # debtor side, by request id
        self.pending: dict[str, PendingMove] = {}  # debtor side, by move id
        self.lost_peers: set[str] = set()
        self.counters = LendingCounters()
        self._next_move = 0

    # -- the engine's view ------------------------------------------------------------------------------------

    def observe(self, state: LocalState) -> None:
        """The engine's current use of its pool (each step, or before each heartbeat)."""
        self.local = state
        self._requests = dict(state.requests)

    @property
    def reserved_blocks(self) -> int:
        return sum(loan.num_blocks for loan in self.loans.values() if loan.state is LoanState.RESERVED)

    @property
    def lent_blocks(self) -> int:
        return sum(loan.num_blocks for loan in self.loans.values() if loan.state is LoanState.FILLED)

    @property
    def free_blocks(self) -> int:
        """Blocks neither its requests, nor a reservation, nor a loan hold."""
        return max(0, self.total_blocks - self.local.own_blocks - self.reserved_blocks - self.lent_blocks)

    @property
    def own_capacity(self) -> int:
        """Blocks its own requests may use: the pool less what it promised or lent."""
        return self.total_blocks - self.reserved_blocks - self.lent_blocks

    def heartbeat(self, step_samples: Sequence[AttentionSample] = ()) -> Heartbeat:
        """The instance and its running requests, as the gManager sees them."""
        requests = tuple(self._request_report(rid, req) for rid, req in self._requests.items())
        local_context = sum(
            max(0, req.num_tokens - self._remote_blocks(rid) * self.block_size) for rid, req in self._requests.items()
        )
        report = InstanceReport(
            instance_id=self.instance_id,
            block_size=self.block_size,
            total_blocks=self.total_blocks,
            free_blocks=self.free_blocks,
            batch_size=self.local.batch_size,
            max_batch_size=self.local.max_batch_size,
            context_tokens=local_context + self.lent_blocks * self.block_size,
            waiting_blocks=tuple(self.local.waiting_blocks),
            queued=tuple(self.local.queued),
            awaiting_grant=tuple(self.local.awaiting_grant),
            lent_blocks=self.lent_blocks,
            reserved_blocks=self.reserved_blocks,
            borrowed_blocks=sum(self._remote_blocks(rid) for rid in self._requests),
        )
        return Heartbeat(report, requests, tuple(step_samples))

    def _request_report(self, request_id: str, req: LocalRequest) -> RequestReport:
        by_creditor: dict[str, int] = {}
        for span in self.spans.get(request_id, ()):
            by_creditor[span.creditor] = by_creditor.get(span.creditor, 0) + span.num_blocks
        return RequestReport(
            request_id=request_id,
            instance_id=self.instance_id,
            num_tokens=req.num_tokens,
            local_blocks=req.local_blocks,
            movable_blocks=len(self._movable(request_id)),
            remote=tuple(sorted(by_creditor.items())),
            waits_for_room=req.waits_for_room,
        )

    # -- debtor side ------------------------------------------------------------------------------------------

    def move_kvcache(self, request_id: str, num_blocks: int, creditor: str) -> list[LendingAction]:
        """Start moving up to ``num_blocks`` of the request's blocks to ``creditor``: ask it to reserve room.

        Moves the request's first run of movable blocks (those nearest its start), so a move never takes the
        block new KV is written to. Fewer than asked move when the run is shorter.
        """
        reason = self._reject_reason(request_id, num_blocks, creditor)
        run = [] if reason else self._first_run(self._movable(request_id), num_blocks)
        if not reason and not run:
            reason = "no movable blocks"
        if reason:
            return [MoveRejected(request_id, creditor, reason)]
        move_id = f"{self.instance_id}/{self._next_move}"
        self._next_move += 1
        self.pending[move_id] = PendingMove(
            move_id, request_id, creditor, run[0], len(run), MoveState.TRYING, self.clock()
        )
        self.counters.moves_started += 1
        return [TryMove(creditor, move_id, request_id, self.instance_id, len(run))]

    def _reject_reason(self, request_id: str, num_blocks: int, creditor: str) -> str:
        if num_blocks <= 0:
            return "nothing to move"
        if creditor == self.instance_id:
            return "a request's blocks cannot be lent to its own instance"
        if creditor in self.lost_peers:
            return f"instance {creditor} is lost"
        if request_id not in self._requests:
            return "not a running request here"
        return ""

    def try_answered(self, move_id: str, creditor: str, accepted: bool) -> list[LendingAction]:
        """``creditor``'s answer to ``try_move_kvcache``: on a yes, send the blocks; on a no, wait for the next
        plan. A yes for a move given up meanwhile gets its reservation released."""
        move = self.pending.get(move_id)
        if move is None:
            return [ReleaseRemote(creditor, move_id)] if accepted else []
        if move.state is not MoveState.TRYING:  # a repeated answer
            return []
        if not accepted:
            del self.pending[move_id]
            self.counters.moves_refused += 1
            return []
        move.state = MoveState.SENDING
        return [SendBlocks(move.creditor, move_id, move.request_id, move.first_block, move.num_blocks)]

    def move_done(self, move_id: str, creditor: str, committed: bool) -> list[LendingAction]:
        """``creditor``'s answer to the blocks sent (False also when the transport lost the answer): on a
        confirmation the blocks live there and the local copies are freed; otherwise the debtor keeps them."""
        if self._is_committed(move_id):  # a repeated answer
            return []
        move = self.pending.pop(move_id, None)
        if move is None or not committed:
            # Given up meanwhile (the request finished, the move timed out), or failed: the creditor must not keep
            # anything for it. The release is idempotent, so it also covers an answer lost on the way.
            if move is not None:
                self.counters.moves_failed += 1
            return [ReleaseRemote(creditor, move_id)]
        span = RemoteSpan(move_id, move.creditor, move.first_block, move.num_blocks)
        self.spans.setdefault(move.request_id, []).append(span)
        req = self._requests.get(move.request_id)
        if req is not None:  # until the engine next reports, count the freed copies as gone
            self._requests[move.request_id] = LocalRequest(req.num_tokens, req.local_blocks - move.num_blocks)
            self.local = _with_own_blocks(self.local, self.local.own_blocks - move.num_blocks)
        self.counters.moves_committed += 1
        self.counters.blocks_moved_out += move.num_blocks
        return [FreeLocalBlocks(move.request_id, move.first_block, move.num_blocks)]

    def request_finished(self, request_id: str) -> list[LendingAction]:
        """The request ended here (finished, aborted, failed over): its creditors free what they hold or
        promised for it."""
        self._requests.pop(request_id, None)
        actions: list[LendingAction] = [ReleaseRemote(s.creditor, s.move_id) for s in self.spans.pop(request_id, [])]
        return actions + self.cancel_moves(request_id)

    def cancel_moves(self, request_id: str) -> list[LendingAction]:
        """Give up the request's moves under way (its local blocks are about to go: preempted, say); the blocks
        it already moved stay where they are. A later yes or confirmation about them is answered with a
        release."""
        actions: list[LendingAction] = []
        for move_id, move in list(self.pending.items()):
            if move.request_id == request_id:
                del self.pending[move_id]
                actions.append(ReleaseRemote(move.creditor, move_id))
        return actions

    def remote_spans(self, request_id: str) -> list[RemoteSpan]:
        """The request's blocks held by creditors, in the order they moved."""
        return list(self.spans.get(request_id, ()))

    def _remote_blocks(self, request_id: str) -> int:
        return sum(s.num_blocks for s in self.spans.get(request_id, ()))

    def _movable(self, request_id: str) -> list[int]:
        """Indices of the request's local blocks a move may take: not the last (being written), none remote,
        none a pending move takes."""
        req = self._requests.get(request_id)
        if req is None or req.local_blocks <= 1:
            return []
        taken: set[int] = set()
        for span in self.spans.get(request_id, ()):
            taken.update(range(span.first_block, span.first_block + span.num_blocks))
        total = req.local_blocks + len(taken)
        local = [i for i in range(total) if i not in taken]
        moving: set[int] = set()
        for move in self.pending.values():
            if move.request_id == request_id:
                moving.update(range(move.first_block, move.first_block + move.num_blocks))
        return [i for i in local[:-1] if i not in moving]

    @staticmethod
    def _first_run(indices: list[int], limit: int) -> list[int]:
        """The leading run of consecutive indices, at most ``limit`` long."""
        run: list[int] = []
        for i in indices:
            if len(run) == limit or (run and i != run[-1] + 1):
                break
            run.append(i)
        return run

    def _is_committed(self, move_id: str) -> bool:
        return any(s.move_id == move_id for spans in self.spans.values() for s in spans)

    # -- creditor side ----------------------------------------------------------------------------------------

    def try_move_kvcache(self, move_id: str, request_id: str, debtor: str, num_blocks: int) -> bool:
        """Reserve ``num_blocks`` for a debtor's move, first come, first served; False when there is no room
        (keeping ``headroom_blocks`` for this instance's own requests) or the debtor is known lost."""
        self._expire_reservations()
        if debtor in self.lost_peers or debtor == self.instance_id or num_blocks <= 0 or move_id in self.loans:
            return False
        if num_blocks > self.free_blocks - self.headroom_blocks:
            return False
        expires_at = self.clock() + self.reservation_timeout_s
        self.loans[move_id] = Loan(move_id, request_id, debtor, num_blocks, LoanState.RESERVED, expires_at)
        return True

    def receive_blocks(self, move_id: str, block_ids: Sequence[int]) -> bool:
        """The debtor's blocks arrived and were written into ``block_ids`` of this pool. True: they are held for
        the debtor (the answer lets it free its copies). False: no live reservation matches (it expired, was
        released, or the debtor is lost); the caller frees ``block_ids`` and the debtor keeps its copies."""
        self._expire_reservations()
        loan = self.loans.get(move_id)
        if loan is None or loan.state is not LoanState.RESERVED or len(block_ids) != loan.num_blocks:
            return False
        loan.state = LoanState.FILLED
        loan.block_ids = tuple(block_ids)
        self.counters.blocks_received += loan.num_blocks
        return True

    def release(self, move_id: str) -> list[LendingAction]:
        """The debtor no longer needs this move's blocks (or its reservation); idempotent."""
        loan = self.loans.pop(move_id, None)
        if loan is None or loan.state is LoanState.RESERVED:
            return []
        return [FreeLentBlocks(loan.debtor, move_id, loan.block_ids)]

    def _expire_reservations(self) -> int:
        now = self.clock()
        expired = [m for m, loan in self.loans.items() if loan.state is LoanState.RESERVED and now >= loan.expires_at]
        for move_id in expired:
            del self.loans[move_id]
        self.counters.reservations_expired += len(expired)
        return len(expired)

    # -- both sides -------------------------------------------------------------------------------------------

    def expire(self) -> list[LendingAction]:
        """Drop reservations nobody filled in time, and give up this instance's moves that got no answer in
        time (their blocks stay here; the creditor is told to release whatever it may hold)."""
        self._expire_reservations()
        deadline = self.clock() - self.reservation_timeout_s
        actions: list[LendingAction] = []
        for move_id, move in list(self.pending.items()):
            if move.started_at <= deadline:
                del self.pending[move_id]
                self.counters.moves_failed += 1
                actions.append(ReleaseRemote(move.creditor, move_id))
        return actions

    def peer_lost(self, instance_id: str) -> list[LendingAction]:
        """Another instance died. As its creditor: free what was held for it. As its debtor: moves to it are off
        (their blocks are still here) and the blocks it held are recomputed."""
        self.lost_peers.add(instance_id)
        actions: list[LendingAction] = []
        for move_id, loan in list(self.loans.items()):
            if loan.debtor == instance_id:
                del self.loans[move_id]
                if loan.state is LoanState.FILLED:
                    actions.append(FreeLentBlocks(instance_id, move_id, loan.block_ids))
        for move_id, move in list(self.pending.items()):
            if move.creditor == instance_id:
                del self.pending[move_id]
                self.counters.moves_failed += 1
        for request_id, spans in self.spans.items():
            lost = [s for s in spans if s.creditor == instance_id]
            if not lost:
                continue
            spans[:] = [s for s in spans if s.creditor != instance_id]
            n = sum(s.num_blocks for s in lost)
            req = self._requests.get(request_id)
            if req is not None:  # the engine recomputes them here: they count as local again
                self._requests[request_id] = LocalRequest(req.num_tokens, req.local_blocks + n)
                self.local = _with_own_blocks(self.local, self.local.own_blocks + n)
            self.counters.blocks_recomputed += n
            actions += [Recompute(request_id, s.first_block, s.num_blocks) for s in lost]
        self.spans = {rid: spans for rid, spans in self.spans.items() if spans}
        return actions

    def peer_back(self, instance_id: str) -> None:
        """An instance lost earlier was started again in its place: a fresh one, which holds and owes nothing here
        (what it lent or borrowed went at its loss, :meth:`peer_lost`), so moves to and from it may start again."""
        self.lost_peers.discard(instance_id)


def _with_own_blocks(state: LocalState, own_blocks: int) -> LocalState:
    return dataclasses.replace(state, own_blocks=own_blocks)
