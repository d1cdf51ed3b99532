"""Which instance serves a call (Autellix §4.3, data-locality-aware load balancing).

Calls of up to ``locality_threshold`` tokens go to the least-loaded live instance: for short calls
the shared system prompt is most of the input, and any instance has it cached. Longer calls go
to the instance that holds their program's KV (its "home": where its last call ran, so the
conversation so far is a prefix-cache hit there), unless that instance has more than
``max_imbalance`` calls beyond the least-loaded one: then queueing would cost more than
recomputing the prefix (SGLang's cache-aware router makes the same trade). ``round-robin`` and
``least-loaded`` exist for comparison. Pure: decisions depend only on the views passed in and the
router's own small state.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass


@dataclass
class InstanceView:
    """What the router knows of an instance: whether it lives (from heartbeats) and its load.

    The load is the router's own count of calls it sent there that have not finished. Every
    call reaches an instance through the router, so the count is exact and current; the
    heartbeat's running and waiting counts say the same thing up to a heartbeat late, and a late
    count would steer calls away from an instance that has long gone idle.
    """

    instance_id: str
    alive: bool = True
    inflight: int = 0

    @property
    def load(self) -> int:
        return self.inflight


class NoLiveInstanceError(RuntimeError):
    pass


class Router:
    def __init__(self, routing: str = "locality", locality_threshold: int = 2048, max_imbalance: int = 4) -> None:
        self.routing = routing
        self.locality_threshold = locality_threshold
        self.max_imbalance = max_imbalance
        self.homes: dict[str, str] = {}  # program id -> instance of its last call (holding its KV)
        self._next = 0

    def choose(self, views: list[InstanceView], program_id: str | None, num_tokens: int) -> str:
        live = [v for v in views if v.alive]
        if not live:
            raise NoLiveInstanceError("no live engine instance")
        if self.routing == "round-robin":
            choice = live[self._next % len(live)]
            self._next += 1
            return choice.instance_id
        # One pass over the views for the least loaded and the program's home (a simulated cluster routes over a
        # thousand instances per call).
        home_id = self.homes.get(program_id) if program_id is not None else None
        lowest = -1
        ties: list[InstanceView] = []
        home = None
        for v in live:
            load = v.load
            if v.instance_id == home_id:
                home = v
            if load < lowest or not ties:
                lowest, ties = load, [v]
            elif load == lowest:
                ties.append(v)
        least = ties[self._next % len(ties)]  # rotate among equals, so idle instances share work
        self._next += 1
        if self.routing == "least-loaded" or program_id is None:
            return least.instance_id
        choice = least
        if num_tokens > self.locality_threshold and home is not None and home.load - least.load <= self.max_imbalance:
            choice = home
        self.homes[program_id] = choice.instance_id
        return choice.instance_id

    def retain(self, program_ids: Container[str]) -> None:
        """Forget the homes of programs not in ``program_ids`` (those the process table dropped)."""
        for pid in [p for p in self.homes if p not in program_ids]:
            del self.homes[pid]

    def drop_instance(self, instance_id: str) -> None:
        """Programs whose home died find a new one at their next call."""
        for pid in [p for p, i in self.homes.items() if i == instance_id]:
            del self.homes[pid]
