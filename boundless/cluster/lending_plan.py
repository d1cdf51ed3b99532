"""Which blocks move where: Infinite-LLM's greedy lending plan (Algorithm 1), driven by the fitted model.

Debtors are instances whose batch is small (at most ``debtor_max_batch``), in increasing batch order;
creditors are instances whose memory use is low (at most ``creditor_max_usage``), in increasing use order. For
each debtor, its longest request (the one with the most blocks a move may take) is offered to each creditor in
turn: the planner evaluates the pair's modelled throughput for moving every ``k`` from 0 to what the request and
the creditor allow, and takes the best ``k`` (the fewest blocks within ``min_gain`` of the best, so that blocks
whose move the model barely tells from none stay put). A best of 0 (no move gains ``min_gain``) ends that
debtor's turn, since the creditors further down are busier. After each move the two instances' modelled states
are updated and the creditors re-sorted.

An instance's modelled state is its batch, its context and its free blocks. Freeing blocks on a debtor admits
its waiting requests, in order, as long as their blocks fit (up to its largest batch); lending blocks takes
them from the creditor's free blocks (its own waiting requests then fit less) and adds their tokens to the
context its steps attend over, since a debtor's attention over its lent blocks runs on the creditor
(DistAttention). Throughput is batch over modelled step time (``cluster/perf_model.py``), summed over the
instances; the model assumes, as the paper's does, that the round trip of the partials overlaps the debtor's
local work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from boundless.cluster.perf_model import decode_throughput
from boundless.cluster.placement import InstanceReport, RequestReport
from boundless.config import ClusterConfig
from boundless.engine.attention_time import AttentionTimeModel


@dataclass(frozen=True)
class LendingThresholds:
    """What makes a debtor, what makes a creditor, and how much of a creditor stays its own."""

    debtor_max_batch: int = 8  # β_thres: instances running at most this many requests may borrow
    creditor_max_usage: float = 0.6  # U_thres: instances using at most this share of their blocks may lend
    creditor_headroom: float = 0.1  # share of a creditor's blocks never lent (its requests grow into them)
    min_gain: float = 0.01  # share of the two instances' modelled throughput a move must gain (and the tolerance)

    @property
    def lend_share(self) -> float:
        """The share of its pool a creditor lends before it stops being one: ``creditor_max_usage``, at most all but
        its headroom (what a request counts on from each other instance)."""
        return max(0.0, min(self.creditor_max_usage, 1.0 - self.creditor_headroom))

    @classmethod
    def from_config(cls, config: ClusterConfig) -> LendingThresholds:
        """The ``--lending-*`` flags' thresholds."""
        return cls(
            debtor_max_batch=config.lending_debtor_max_batch,
            creditor_max_usage=config.lending_creditor_max_usage,
            creditor_headroom=config.lending_creditor_headroom,
            min_gain=config.lending_min_gain,
        )


@dataclass(frozen=True)
class MoveOrder:
    """Tell ``debtor`` to move ``num_blocks`` of ``request_id``'s blocks to ``creditor`` (``move_kvcache``)."""

    request_id: str
    debtor: str
    creditor: str
    num_blocks: int


@dataclass(frozen=True)
class HoldOrder:
    """Tell ``instance`` (the rManager's id) to drop ``request_id``'s KV to recompute and hold it back until
    released; ``yields_to``: every other request there at the hold, running or queued (it is released once none
    of them is there any more)."""

    request_id: str
    instance: str
    yields_to: frozenset[str]


@dataclass(frozen=True)
class ReleaseOrder:
    """Tell ``instance`` that ``request_id``, held back, may be admitted again."""

    request_id: str
    instance: str


@dataclass(frozen=True)
class GrantOrder:
    """Tell ``instance`` that ``request_id``, longer than its pool, may start (``cluster/lending_grants.py``);
    ``creditors``: the instances counted on to lend it the rest, taken by no other grant while it is in force."""

    request_id: str
    instance: str
    creditors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RefuseOrder:
    """Tell ``instance`` to fail ``request_id``, which awaited a grant that the live instances could not give it for
    ``lending_grant_timeout_s`` (``cluster/lending_grants.py``, :func:`ungrantable`)."""

    request_id: str
    instance: str


@dataclass(frozen=True)
class LendingPlan:
    """The moves, and the cluster's modelled throughput (tokens/s) before and after them; the gManager adds the
    deadlock breaker's holds and releases (``cluster/lending_deadlock.py``)."""

    moves: tuple[MoveOrder, ...]
    throughput_before: float
    throughput_after: float
    holds: tuple[HoldOrder, ...] = ()
    releases: tuple[ReleaseOrder, ...] = ()


@dataclass
class _Modelled:
    """An instance as the planner changes it."""

    report: InstanceReport
    free: int
    context: int
    lent: int = 0  # blocks this plan lends from it
    borrowed: int = 0  # blocks this plan moves off it

    @classmethod
    def of(cls, report: InstanceReport) -> _Modelled:
        return cls(report, report.free_blocks, report.context_tokens)

    def batch_and_context(self, free: int, context: int) -> tuple[int, int]:
        """The batch it runs and the context it attends over with ``free`` blocks: its waiting requests are
        admitted in order while their blocks fit."""
        r = self.report
        batch, room = r.batch_size, free
        for blocks in r.waiting_blocks:
            if batch >= r.max_batch_size or blocks > room:
                break
            batch += 1
            room -= blocks
            context += blocks * r.block_size
        return batch, context

    def throughput(self, model: AttentionTimeModel, free: int | None = None, context: int | None = None) -> float:
        batch, ctx = self.batch_and_context(
            self.free if free is None else free, self.context if context is None else context
        )
        return decode_throughput(model, batch, ctx)

    @property
    def usage(self) -> float:
        return (self.report.total_blocks - self.free) / max(1, self.report.total_blocks)

    def lendable(self, headroom: float) -> int:
        keep = int(headroom * self.report.total_blocks + 0.5)
        return max(0, self.free - keep)


def lendable_blocks(report: InstanceReport, thresholds: LendingThresholds) -> int:
    """The blocks an instance may lend now: none above the creditor usage threshold, else its free blocks less its
    headroom (as the planner counts a creditor)."""
    node = _Modelled.of(report)
    return node.lendable(thresholds.creditor_headroom) if node.usage <= thresholds.creditor_max_usage else 0


def request_pools(instances: int, thresholds: LendingThresholds) -> float:
    """The pools' worth of KV one request can count on with lending across ``instances``: its own instance's, and
    on each other one what a creditor lends before it stops being one (``creditor_max_usage`` of its pool, at most
    all but its headroom). ``serve --kv-lending on --lending-request-pools`` admits contexts up to it at most
    (``size_engine``'s ``pools``): a request longer would wait for good for room no plan lends."""
    return 1.0 + (instances - 1) * thresholds.lend_share


def served_request_pools(config: ClusterConfig) -> float:
    """The pools' worth of KV a request may hold in ``serve --kv-lending on``: ``--lending-request-pools``, at most
    what the others lend (:func:`request_pools`)."""
    return min(config.lending_request_pools, request_pools(config.instances, LendingThresholds.from_config(config)))


def plan_lending(
    reports: Sequence[InstanceReport],
    requests: Sequence[RequestReport],
    model: AttentionTimeModel,
    thresholds: LendingThresholds,
) -> LendingPlan:
    """Algorithm 1 over the latest reports of the live instances (see the module)."""
    nodes = {r.instance_id: _Modelled.of(r) for r in reports}
    before = sum(n.throughput(model) for n in nodes.values())
    debtors = sorted(
        (n for n in nodes.values() if n.report.batch_size <= thresholds.debtor_max_batch),
        key=lambda n: (n.report.batch_size, n.report.instance_id),
    )
    movable = {r.request_id: r for r in requests if r.instance_id in nodes}
    moves: list[MoveOrder] = []
    for debtor in debtors:
        if debtor.lent:  # it lent in this plan already: borrowing now would only move blocks back and forth
            continue
        request = _longest(debtor.report.instance_id, movable.values())
        if request is None:
            continue
        block_max = request.movable_blocks
        for creditor in _creditors(nodes, debtor, thresholds):
            if block_max <= 0:
                break
            best = _best_move(
                debtor, creditor, min(block_max, creditor.lendable(thresholds.creditor_headroom)), model, thresholds
            )
            if best <= 0:
                break
            moves.append(MoveOrder(request.request_id, debtor.report.instance_id, creditor.report.instance_id, best))
            _apply(debtor, creditor, best)
            block_max -= best
    after = sum(n.throughput(model) for n in nodes.values())
    return LendingPlan(tuple(moves), before, after)


def room_moves(
    reports: Sequence[InstanceReport],
    requests: Sequence[RequestReport],
    thresholds: LendingThresholds,
    planned: Sequence[MoveOrder] = (),
) -> tuple[MoveOrder, ...]:
    """Moves for the requests that wait for room (their local blocks fill their pool) and that the plan gave none:
    each takes what the creditor with the most to lend may lend (``lendable_blocks``, less what the plan already
    takes from it), up to its movable blocks. A request that cannot grow at all gains whatever the model says:
    without these, one waited while an idle instance had its whole pool free, before the model was fitted (no
    plan moves anything then) or when the model's gain fell under ``min_gain``."""
    moved = {m.request_id for m in planned}
    debtors = {m.debtor for m in planned}
    taken: dict[str, int] = {}
    for m in planned:
        taken[m.creditor] = taken.get(m.creditor, 0) + m.num_blocks
    room = {
        r.instance_id: lendable_blocks(r, thresholds) - taken.get(r.instance_id, 0)
        for r in reports
        if r.instance_id not in debtors
    }
    out: list[MoveOrder] = []
    waiting = sorted(
        (r for r in requests if r.waits_for_room and r.request_id not in moved), key=lambda r: r.request_id
    )
    for request in waiting:
        creditors = [iid for iid, n in room.items() if iid != request.instance_id and n > 0]
        if not creditors or request.movable_blocks <= 0:
            continue
        creditor = max(creditors, key=lambda iid: (room[iid], iid))
        k = min(request.movable_blocks, room[creditor])
        out.append(MoveOrder(request.request_id, request.instance_id, creditor, k))
        room[creditor] -= k
        room.pop(request.instance_id, None)  # it borrows now: it lends nothing in the same plan
    return tuple(out)


def _longest(instance_id: str, requests: Iterable[RequestReport]) -> RequestReport | None:
    """The debtor's request with the most movable blocks (the most memory a move of it can free)."""
    mine = [r for r in requests if r.instance_id == instance_id and r.movable_blocks > 0]
    return max(mine, key=lambda r: (r.movable_blocks, r.num_tokens), default=None)


def _creditors(nodes: dict[str, _Modelled], debtor: _Modelled, thresholds: LendingThresholds) -> list[_Modelled]:
    """Instances with low memory use, least used first; re-sorted on each call, as moves change their use."""
    return sorted(
        (n for n in nodes.values() if n is not debtor and not n.borrowed and n.usage <= thresholds.creditor_max_usage),
        key=lambda n: (n.usage, n.report.instance_id),
    )


def _best_move(
    debtor: _Modelled, creditor: _Modelled, limit: int, model: AttentionTimeModel, thresholds: LendingThresholds
) -> int:
    """How many blocks in ``[0, limit]`` to move: 0 unless the best move raises the pair's modelled throughput
    by ``min_gain`` at least, else the fewest blocks that come within ``min_gain`` of the best (moving more
    would add bytes to move for no gain the model can tell from noise)."""
    base = debtor.throughput(model) + creditor.throughput(model)
    block_tokens = debtor.report.block_size
    totals = [base]
    for k in range(1, limit + 1):
        moved = k * block_tokens
        totals.append(
            debtor.throughput(model, debtor.free + k, debtor.context - moved)
            + creditor.throughput(model, creditor.free - k, creditor.context + moved)
        )
    best = max(totals)
    tolerance = thresholds.min_gain * base
    if best - base < tolerance or best <= base:
        return 0
    return next(k for k, total in enumerate(totals) if total >= best - tolerance and k > 0)


def _apply(debtor: _Modelled, creditor: _Modelled, k: int) -> None:
    moved = k * debtor.report.block_size
    debtor.free += k
    debtor.context -= moved
    debtor.borrowed += k
    creditor.free -= k
    creditor.context += moved
    creditor.lent += k
