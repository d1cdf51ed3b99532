"""KV lending's deadlock, and the preemption that breaks it.

A request whose local blocks fill its instance's pool keeps them until a move makes room
(``Scheduler.waits_for_room``): evicting it would bring it back to the same wall. Two such requests on two
instances, with no instance able to lend, wait for each other for good: nothing runs, so nothing frees memory,
and no plan has blocks to move. So does one such request beside a request swapped out on its instance whose
blocks on the other instance fill that one's pool. :func:`find_deadlock` recognises that state in the
instances' heartbeats:

- a request waits for room, and every running request does (one that can still grow, or that its scheduler will
  evict to make room for another, may end and free memory); and another request is there to gain from a hold: a
  second one waiting for room, or one queued on any instance;
- no instance runs a step (its batch holds only requests that cannot grow) or has blocks reserved for a move
  under way (it may make room);
- no instance may lend a block (``lendable_blocks``: as the planner counts a creditor), or the planner, with a
  fitted model, moved none: what they may lend is too little for any waiting request's next chunk.

It then names a victim: the waiting request held back the fewest times before, then the one holding the fewest
blocks, here and on creditors (the least work to recompute), then the newest; and the others it yields to: every
other request there, running or queued. Held back before counts first: released, a request takes its pool again
and meets the requests that arrived meanwhile; chosen by blocks alone (ties fall to the lower id), one request of
validate's seed-5 chat programs was held 8 times over while newer requests passed it, each time its 768-token
prefill recomputed. The gManager orders the
victim's instance to drop its KV to recompute later and to hold it back (``Scheduler.hold``): the blocks it freed
go to the others (their own instance's, or lent by the next plans). It releases it once none of those is there
any more (finished, or lost with its instance); then its turn comes as any waiting request's. Released as soon as
the other waiters ran on, it came back, took its pool again and made the same deadlock with the requests queued
meanwhile: a real run held one request 9 times over, then stalled. A request that alone needs more than the
cluster lends cannot be helped so: the server does not admit it (``lending_plan.request_pools``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from boundless.cluster.lending_plan import HoldOrder, LendingThresholds, lendable_blocks
from boundless.cluster.placement import InstanceReport, RequestReport


def find_deadlock(
    instances: Sequence[InstanceReport],
    requests: Sequence[RequestReport],
    thresholds: LendingThresholds,
    planned: bool = False,
    times_held: Mapping[str, int] | None = None,
    arrival: Mapping[str, int] | None = None,
) -> HoldOrder | None:
    """The hold that breaks a lending deadlock among these heartbeats' instances, or None when there is none (see
    the module). ``planned``: the planner ran on them with a fitted model and moved nothing, so what the instances
    may lend is too little for any waiting request's next chunk. ``times_held``: how often each request was held
    back before; ``arrival``: the order requests were first seen in (a larger number is newer)."""
    waiting = [r for r in requests if r.waits_for_room]
    if not waiting or len(waiting) < len(requests):
        return None  # a running request that can still grow, or be evicted to make room, may free some
    queued = [rid for i in instances for rid in i.queued]
    if len(waiting) < 2 and not queued:
        return None  # alone in the cluster: holding it back frees room for nobody
    if any(i.batch_size > 0 or i.reserved_blocks > 0 for i in instances):
        return None  # a step or a move under way may free room
    if not planned and any(lendable_blocks(i, thresholds) > 0 for i in instances):
        return None  # the planner can move blocks once it has a model
    held, seen = times_held or {}, arrival or {}
    victim = min(
        waiting, key=lambda r: (held.get(r.request_id, 0), r.total_blocks, -seen.get(r.request_id, 0), r.request_id)
    )
    others = frozenset(r.request_id for r in waiting if r is not victim) | frozenset(queued)
    return HoldOrder(victim.request_id, victim.instance_id, others)
