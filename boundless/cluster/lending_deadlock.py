"""KV lending's deadlock, and the preemption that breaks it.

A request whose local blocks fill its instance's pool keeps them until a move makes room
(``Scheduler.waits_for_room``): evicting it would bring it back to the same wall. Two such requests on two
instances, with no instance able to lend, wait for each other for good: nothing runs, so nothing frees memory,
and no plan has blocks to move. :func:`find_deadlock` recognises that state in the instances' heartbeats:

- two requests or more wait for room, and every running request does (one that can still grow, or that its
  scheduler will evict to make room for another, may end and free memory);
- no instance runs a step (its batch is empty: only requests that cannot grow) or has blocks reserved for a move
  under way (it may make room);
- no instance may lend a block (``lendable_blocks``: as the planner counts a creditor), or the planner, with a
  fitted model, moved none: what they may lend is too little for any waiting request's next chunk.

It then names a victim: the waiting request holding the fewest blocks, here and on creditors (the least work to
recompute), and the others it yields to. The gManager orders the victim's instance to drop its KV to recompute
later and to hold it back (``Scheduler.hold``): the blocks it freed are lent to the others by the next plans. It
releases it once none of those runs any more (finished, or preempted by its own instance's scheduler, or lost
with its instance): then its turn comes as any waiting request's. The others grow into the freed pool (new
arrivals may take part of it first; then the breaker acts again). A request that alone needs more than the
cluster lends cannot be helped so: the server does not admit it (``lending_plan.request_pools``).
"""

from __future__ import annotations

from collections.abc import Sequence

from boundless.cluster.lending_plan import HoldOrder, LendingThresholds, lendable_blocks
from boundless.cluster.placement import InstanceReport, RequestReport


def find_deadlock(
    instances: Sequence[InstanceReport],
    requests: Sequence[RequestReport],
    thresholds: LendingThresholds,
    planned: bool = False,
) -> HoldOrder | None:
    """The hold that breaks a lending deadlock among these heartbeats' instances, or None when there is none (see
    the module). ``planned``: the planner ran on them with a fitted model and moved nothing, so what the instances
    may lend is too little for any waiting request's next chunk."""
    waiting = [r for r in requests if r.waits_for_room]
    if len(waiting) < 2 or len(waiting) < len(requests):
        return None  # a running request that can still grow, or be evicted to make room, may free some
    if any(i.batch_size > 0 or i.reserved_blocks > 0 for i in instances):
        return None  # a step or a move under way may free room
    if not planned and any(lendable_blocks(i, thresholds) > 0 for i in instances):
        return None  # the planner can move blocks once it has a model
    victim = min(waiting, key=lambda r: (r.total_blocks, r.request_id))
    others = frozenset(r.request_id for r in waiting if r is not victim)
    return HoldOrder(victim.request_id, victim.instance_id, others)
