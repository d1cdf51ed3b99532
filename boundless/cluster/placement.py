"""Where KV blocks live across instances, as each instance's rManager reports it to the gManager.

Plain data, shared by the rManagers that produce it (``cluster/rmanager.py``) and the gManager that plans
from it (``cluster/gmanager.py``, ``cluster/lending_plan.py``). The per-request entry is Infinite-LLM's
``RequestPlacementEntry``; the per-instance report carries what the planner's performance model needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from boundless.engine.attention_time import AttentionSample


@dataclass(frozen=True)
class RequestPlacementEntry:
    """``num_blocks`` blocks of request ``request_id`` held by instance ``instance_id``; ``local`` when that is
    the request's own instance (its debtor), else a creditor holds them."""

    request_id: str
    instance_id: str
    num_blocks: int
    local: bool


@dataclass(frozen=True)
class RequestReport:
    """A running request as its own instance reports it.

    ``movable_blocks`` are the local blocks a move may take now: not the last one (new KV is written there)
    and none a move under way already takes. ``remote`` lists (creditor, blocks) for its blocks held elsewhere.
    ``waits_for_room``: its local blocks fill its instance's pool and it has more to compute; it keeps them until
    a move makes room (the deadlock breaker, ``cluster/lending_deadlock.py``, looks for such requests).
    """

    request_id: str
    instance_id: str
    num_tokens: int
    local_blocks: int
    movable_blocks: int
    remote: tuple[tuple[str, int], ...] = ()
    waits_for_room: bool = False

    @property
    def remote_blocks(self) -> int:
        return sum(n for _, n in self.remote)

    @property
    def total_blocks(self) -> int:
        return self.local_blocks + self.remote_blocks

    def entries(self) -> list[RequestPlacementEntry]:
        """The request's placement entries: its local blocks, then each creditor's."""
        local = [RequestPlacementEntry(self.request_id, self.instance_id, self.local_blocks, True)]
        return local + [RequestPlacementEntry(self.request_id, c, n, False) for c, n in self.remote]


@dataclass(frozen=True)
class InstanceReport:
    """One instance's memory and batch.

    ``free_blocks`` is what neither its own requests, nor reservations, nor loans hold. ``context_tokens`` is
    what one decode step attends over there: its requests' local context plus the blocks it lends (the
    debtors' attention over them runs here). ``waiting_blocks`` gives the blocks each waiting request needs to
    be admitted, in the order it would be.
    """

    instance_id: str
    block_size: int
    total_blocks: int
    free_blocks: int
    batch_size: int
    max_batch_size: int
    context_tokens: int
    waiting_blocks: tuple[int, ...] = ()
    queued: tuple[str, ...] = ()  # its waiting requests (not those held back, nor those awaiting a grant)
    # Requests longer than its pool waiting for the gManager's grant to start (``cluster/lending_grants.py``), in
    # its scheduler's order, each with the blocks its peak needs (its prompt and ``max_tokens``).
    awaiting_grant: tuple[tuple[str, int], ...] = ()
    lent_blocks: int = 0  # held for debtors, filled
    reserved_blocks: int = 0  # promised to debtors, not yet filled
    borrowed_blocks: int = 0  # of its requests' blocks, those held by creditors

    @property
    def usage(self) -> float:
        """The share of its blocks in use (its own, reserved or lent)."""
        return (self.total_blocks - self.free_blocks) / max(1, self.total_blocks)


@dataclass(frozen=True)
class Heartbeat:
    """What an rManager sends the gManager every interval: its instance, its running requests, and the step
    samples its engine recorded since the last heartbeat (for the performance model)."""

    instance: InstanceReport
    requests: tuple[RequestReport, ...] = ()
    step_samples: tuple[AttentionSample, ...] = ()

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id
