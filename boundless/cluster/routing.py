"""Which instance serves a call (Autellix §4.3, data-locality-aware load balancing).

Calls of up to ``locality_threshold`` tokens go to the least-loaded live instance: for short calls
the shared system prompt is most of the input, and any instance has it cached. Longer calls go
to the instance that holds their program's KV (its "home"), where the conversation so far is a
prefix-cache hit. ``round-robin`` and ``least-loaded`` exist for comparison. Pure: decisions
depend only on the views passed in and the router's own small state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InstanceView:
    """What the router knows of an instance, from heartbeats and its own bookkeeping."""

    instance_id: str
    alive: bool = True
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0  # calls the router sent there that have not finished

    @property
    def load(self) -> tuple[float, float]:
        # In-flight calls count immediately (heartbeats lag); KV usage breaks ties.
        return (max(self.inflight, self.num_running + self.num_waiting), self.kv_usage)


class NoLiveInstanceError(RuntimeError):
    pass


class Router:
    def __init__(self, routing: str = "locality", locality_threshold: int = 2048) -> None:
        self.routing = routing
        self.locality_threshold = locality_threshold
        self.homes: dict[str, str] = {}  # program id -> instance holding its KV
        self._next = 0

    def choose(self, views: list[InstanceView], program_id: str | None, num_tokens: int) -> str:
        live = [v for v in views if v.alive]
        if not live:
            raise NoLiveInstanceError("no live engine instance")
        if self.routing == "round-robin":
            choice = live[self._next % len(live)]
            self._next += 1
            return choice.instance_id
        lowest = min(v.load for v in live)
        ties = [v for v in live if v.load == lowest]
        least = ties[self._next % len(ties)].instance_id  # rotate among equals, so idle instances share work
        self._next += 1
        if self.routing == "least-loaded" or program_id is None:
            return least
        home = self.homes.get(program_id)
        if home not in {v.instance_id for v in live}:
            home = None
        if num_tokens > self.locality_threshold:
            if home is None:  # the program's first long context: it lives on the least-loaded instance
                home = self.homes[program_id] = least
            return home
        if home is None:
            self.homes[program_id] = least
        return least

    def forget(self, program_id: str) -> None:
        self.homes.pop(program_id, None)

    def drop_instance(self, instance_id: str) -> None:
        """Programs whose home died find a new one at their next call."""
        for pid in [p for p, i in self.homes.items() if i == instance_id]:
            del self.homes[pid]
