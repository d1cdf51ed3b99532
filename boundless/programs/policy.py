"""The order in which the engine serves requests, as a pluggable, pure policy object.

The scheduler asks a policy for each request's priority (smaller is served first and preempted
last) and reports to it the service each request received. Policies never read wall time: the
scheduler passes ``now`` from the clock it was given.
"""

from __future__ import annotations

import itertools
import math
from typing import Protocol

from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef


class Call(Protocol):
    """What a policy reads of a request (the engine's ``Request`` is one): it never sees tokens or KV."""

    @property
    def request_id(self) -> str: ...

    @property
    def arrival_time(self) -> float: ...

    @property
    def program(self) -> ProgramRef | None: ...


def program_of(request: Call) -> ProgramRef:
    """The program a call belongs to: a call with no program id is a program of its own."""
    return request.program or ProgramRef(program_id=request.request_id)


class SchedulingPolicy(Protocol):
    """The order of service, decided from arrivals, reported service and the clock.

    ``table`` is its process table, and :meth:`program_priority` where a program stands in the order of
    service: program-aware KV eviction reads both.
    """

    table: ProcessTable

    @property
    def name(self) -> str:
        """The policy's name (``--policy``): a class attribute of each."""
        ...

    def program_priority(self, program_id: str) -> tuple[float, ...]:
        """When the policy would serve the program next (smaller first): the leading terms of the priority of
        its most urgent call in the engine or, with none, of the call it would make next (those that order
        programs, not calls within one)."""
        ...

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
    """First come, first served (vLLM's order): by arrival time, ties by arrival order.

    Its process table records only when programs are active (for program-aware KV eviction); the order of
    service needs no program history.
    """

    name = "fcfs"

    def __init__(self, ttl_s: float = 600.0) -> None:
        self._order: dict[str, int] = {}
        self._programs: dict[str, ProgramRef] = {}
        self._arrivals: dict[str, dict[str, float]] = {}  # program -> its calls' arrival times, by request id
        self._counter = itertools.count()
        self.table = ProcessTable(ttl_s=ttl_s)

    def program_priority(self, program_id: str) -> tuple[float, ...]:
        # An idle program's next call arrives after every call here.
        arrivals = self._arrivals.get(program_id)
        return (min(arrivals.values()),) if arrivals else (math.inf,)

    def on_arrival(self, request: Call, now: float) -> None:
        self._order[request.request_id] = next(self._counter)
        program = program_of(request)
        self._programs[request.request_id] = program
        self._arrivals.setdefault(program.program_id, {})[request.request_id] = request.arrival_time
        self.table.call_arrived(program, now)

    def merge_remote_service(self, program: ProgramRef) -> None:
        pass  # arrival order needs no program history

    def update(self, now: float) -> None:
        self.table.expire_due(now)

    def priority(self, request: Call, now: float) -> tuple:
        return (request.arrival_time, self._order.get(request.request_id, 0))

    def on_service(self, request: Call, service_s: float, now: float) -> None:
        pass

    def on_finish(self, request: Call, now: float) -> None:
        self._order.pop(request.request_id, None)
        program = self._programs.pop(request.request_id, None)
        if program is not None:
            arrivals = self._arrivals[program.program_id]
            del arrivals[request.request_id]
            if not arrivals:
                del self._arrivals[program.program_id]
            self.table.call_finished(program, 0.0, 0.0, now)
