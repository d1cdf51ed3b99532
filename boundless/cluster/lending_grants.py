"""Which requests longer than one pool may start: the gManager's grants.

With ``--lending-request-pools`` above 1 a request may need more KV than its instance's pool: it computes until
its local blocks fill the pool, then waits for a move to a creditor (``Scheduler.waits_for_room``). Two such
requests started at once on two instances each fill their own pool, so neither instance can lend to the other:
the deadlock breaker (``cluster/lending_deadlock.py``) then drops one to recompute. On a trace of many such
requests that is most of what happens: validate's seed-5 chat programs (12 programs on two 48-block pools at 1.6
pools) held requests back 18 times in the simulator and 20-29 times on the real cluster, each hold a 768-token
prefill thrown away, and one request was held 8 times over.

So an instance starts a request whose peak (its prompt and its ``max_tokens``) needs more blocks than its pool
only once the gManager grants it (``Scheduler.grant``); until then it stays queued, holding nothing. The gManager
grants in the order it first heard of the requests, each with its own instance and enough creditors for what it
needs beyond its pool, none of them host or creditor of another grant in force: an instance counts on lending a
share ``LendingThresholds.lend_share`` of its pool, as ``lending_plan.request_pools`` counts it. A grant ends when
its request is no longer reported anywhere (finished, or lost with its instance).

A request that no arrangement of the live instances can hold (:func:`ungrantable`: one was lost, and the rest cannot
lend it enough even all at once) is never granted; the gManager fails it once it has been so for
``lending_grant_timeout_s`` (a lost instance restarted within it lets it start), and the client gets a 503, not a
call that never ends. The server does not admit one that needs more than ``request_pools`` (``size_engine``). A
request without ``max_tokens`` is admitted on its prompt; past its pool it relies on the plans and the breaker, as
before.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from boundless.cluster.lending_plan import GrantOrder, LendingThresholds
from boundless.cluster.placement import InstanceReport


def creditor_share_blocks(report: InstanceReport, thresholds: LendingThresholds) -> float:
    """The blocks a grant counts on an instance lending: its pool's lendable share. Not rounded, as
    ``request_pools`` does not round it: the server's context limit on three 48-block pools is 105 blocks (2.2
    pools), 57 beyond one pool, which two creditors of 28.8 cover and two of 28 would not."""
    return thresholds.lend_share * report.total_blocks


def ungrantable(instances: Sequence[InstanceReport], thresholds: LendingThresholds) -> list[tuple[str, str]]:
    """The requests awaiting a grant (each with its instance) that these instances could not hold even if every
    other one lent it its whole share and no grant were in force."""
    lendable = {i.instance_id: creditor_share_blocks(i, thresholds) for i in instances}
    everyone = sum(lendable.values())
    return [
        (rid, i.instance_id)
        for i in instances
        for rid, blocks in i.awaiting_grant
        if blocks - i.total_blocks > everyone - lendable[i.instance_id] + 1e-9
    ]


def plan_grants(
    instances: Sequence[InstanceReport],
    in_force: Collection[GrantOrder],
    thresholds: LendingThresholds,
    arrival: Mapping[str, int] | None = None,
) -> tuple[GrantOrder, ...]:
    """The grants to give now to the requests the instances report awaiting one (see the module), given those
    ``in_force``. ``arrival``: the order requests were first heard of in (a larger number is newer); the oldest
    is granted first, and a newer one whose instances are free goes ahead of one whose are taken."""
    seen = arrival or {}
    reports = {i.instance_id: i for i in instances}
    taken = {g.instance for g in in_force} | {c for g in in_force for c in g.creditors}
    awaiting = sorted(
        ((seen.get(rid, 0), rid, i.instance_id, blocks) for i in instances for rid, blocks in i.awaiting_grant),
    )
    grants: list[GrantOrder] = []
    for _, rid, host, blocks in awaiting:
        if host in taken:
            continue
        beyond: float = blocks - reports[host].total_blocks
        # Instances whose own requests await a grant lend last (they may host one); then the freest first.
        free = sorted(
            (r for iid, r in reports.items() if iid != host and iid not in taken),
            key=lambda r: (bool(r.awaiting_grant), -r.free_blocks, r.instance_id),
        )
        creditors: list[str] = []
        for r in free:
            if beyond <= 0:
                break
            share = creditor_share_blocks(r, thresholds)
            if share > 0:
                creditors.append(r.instance_id)
                beyond -= share
        if beyond > 1e-9:
            continue  # not enough instances free to lend it what it needs: it waits for a grant to end
        grant = GrantOrder(rid, host, tuple(creditors))
        grants.append(grant)
        taken |= {host, *creditors}
    return tuple(grants)
