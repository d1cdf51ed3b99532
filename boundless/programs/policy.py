"""The order in which the engine serves requests, as a pluggable, pure policy object.

The scheduler asks a policy for each request's priority (smaller is served first and preempted
last) and reports to it the service each request received. Policies never read wall time: the
scheduler passes ``now`` from the clock it was given.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from boundless.programs.ref import ProgramRef


class Call(Protocol):
    """What a policy reads of a request (the engine's ``Request`` is one): it never sees tokens or KV."""

    @property
    def request_id(self) -> str: ...

    @property
    def arrival_time(self) -> float: ...

    @property
    def program(self) -> ProgramRef | None: ...


class SchedulingPolicy(Protocol):
    """The order of service, decided from arrivals, reported service and the clock."""

    name: str

    def on_arrival(self, request: Call, now: float) -> None: ...

    def merge_remote_service(self, program: ProgramRef) -> None:
        """Adopt the service and waiting a router saw the program receive on every instance,
        when the call carries them (``program.service_s`` is not None)."""
        ...

    def update(self, now: float) -> None:
        """Called once at the start of every scheduling decision (promotions, expiry)."""
        ...

    def priority(self, request: Call, now: float) -> tuple: ...

    def on_service(self, request: Call, service_s: float, now: float) -> None: ...

    def on_finish(self, request: Call, now: float) -> None: ...


class FCFSPolicy:
    """First come, first served (vLLM's order): by arrival time, ties by arrival order."""

    name = "fcfs"

    def __init__(self) -> None:
        self._order: dict[str, int] = {}
        self._counter = itertools.count()

    def on_arrival(self, request: Call, now: float) -> None:
        self._order[request.request_id] = next(self._counter)

    def merge_remote_service(self, program: ProgramRef) -> None:
        pass  # arrival order needs no program history

    def update(self, now: float) -> None:
        pass

    def priority(self, request: Call, now: float) -> tuple:
        return (request.arrival_time, self._order.get(request.request_id, 0))

    def on_service(self, request: Call, service_s: float, now: float) -> None:
        pass

    def on_finish(self, request: Call, now: float) -> None:
        self._order.pop(request.request_id, None)
