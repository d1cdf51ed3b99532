"""The order in which the engine serves requests, as a pluggable, pure policy object.

The scheduler asks a policy for each request's priority (smaller is served first and preempted
last) and reports to it the service each request received. Policies never read wall time: the
scheduler passes ``now`` from the clock it was given.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from boundless.engine.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def on_arrival(self, request: Request, now: float) -> None: ...

    def update(self, now: float) -> None:
        """Called once at the start of every scheduling decision (promotions, expiry)."""
        ...

    def priority(self, request: Request, now: float) -> tuple: ...

    def on_service(self, request: Request, service_s: float, now: float) -> None: ...

    def on_finish(self, request: Request, now: float) -> None: ...


class FCFSPolicy:
    """First come, first served (vLLM's order): by arrival time, ties by arrival order."""

    name = "fcfs"

    def __init__(self) -> None:
        self._order: dict[str, int] = {}
        self._counter = itertools.count()

    def on_arrival(self, request: Request, now: float) -> None:
        self._order[request.request_id] = next(self._counter)

    def update(self, now: float) -> None:
        pass

    def priority(self, request: Request, now: float) -> tuple:
        return (request.arrival_time, self._order.get(request.request_id, 0))

    def on_service(self, request: Request, service_s: float, now: float) -> None:
        pass

    def on_finish(self, request: Request, now: float) -> None:
        self._order.pop(request.request_id, None)
