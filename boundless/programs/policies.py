"""Program-aware policies (Autellix §4.2): MLFQ, PLAS and ATLAS over K discretized queues.

All three keep K queues Q1..QK with contiguous service ranges [0, b1), [b1, b2), ... [b_{K-1}, inf)
and a quantum per queue. A call that uses up its queue's quantum moves one queue down (call-level
preemption, so a long decode cannot hold the batch). They differ in where a new call starts:

- ``mlfq``: every new call starts in Q1 (call-level; long programs' new calls jump ahead);
- ``plas``: in the queue whose range holds its program's attained service (the sum of its
  completed calls' model time), so later calls of long programs start low;
- ``atlas``: the same with the program's critical path over its threads (a DAG), so parallel
  threads do not inflate a program's priority, and equal to plas for single-threaded programs.

Anti-starvation: a call whose (program wait + call wait) / (program service + call service)
reaches ``beta`` goes back to Q1; the program's wait and service are both sums over its completed
calls. Within a queue, calls are served in arrival order, or (with ``order_by_program``, plas and
atlas) in their program's first-arrival order, so that one program's calls follow one another
instead of interleaving with its peers' and its prefix cache stays warm. Service is model
execution time reported by the engine's clock. Policies are pure: given the same calls, services
and clock readings they make the same decisions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from boundless.programs.policy import Call, program_of
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef


@dataclass(frozen=True)
class QueueConfig:
    """K queues; queue i covers service [boundaries[i-1], boundaries[i]) and has quantum quanta[i]."""

    num_queues: int = 12
    base_s: float = 0.1  # upper bound of Q1's range
    growth: float = 2.0  # each range is this many times wider than the one above
    beta: float = 10.0  # anti-starvation threshold on wait / service
    ttl_s: float = 600.0  # programs idle this long leave the process table
    max_programs: int = 100_000
    order_by_program: bool = True  # within a queue: by program first arrival, then call arrival

    def __post_init__(self) -> None:
        if self.num_queues < 1:
            raise ValueError("num_queues must be >= 1")
        if self.base_s <= 0 or self.growth <= 1:
            raise ValueError("base_s must be positive and growth > 1")
        if self.beta <= 0:
            raise ValueError("beta must be positive")

    @cached_property  # read for every call of every step
    def boundaries(self) -> tuple[float, ...]:
        """Upper bounds of Q1..Q(K-1); QK is unbounded."""
        return tuple(self.base_s * self.growth**i for i in range(self.num_queues - 1))

    @cached_property
    def quanta(self) -> tuple[float, ...]:
        """Each queue's quantum is the width of its range (QK's is unbounded)."""
        b = (0.0, *self.boundaries)
        return tuple(b[i + 1] - b[i] for i in range(self.num_queues - 1)) + (float("inf"),)

    def queue_for(self, service_s: float) -> int:
        for i, upper in enumerate(self.boundaries):
            if service_s < upper:
                return i
        return self.num_queues - 1


@dataclass
class CallState:
    level: int
    arrival: float
    order: int
    program: ProgramRef
    service_s: float = 0.0  # this call's model time so far
    level_service_s: float = 0.0  # model time since it entered its current queue
    promotions: int = 0
    demotions: int = 0


class MultiLevelQueuePolicy:
    """The shared mechanism; subclasses choose where a new call starts."""

    name: ClassVar[str] = "mlq"
    program_level: ClassVar[bool] = True

    def __init__(self, config: QueueConfig | None = None, table: ProcessTable | None = None) -> None:
        self.config = config or QueueConfig()
        self.table = table or ProcessTable(
            ttl_s=self.config.ttl_s, max_programs=self.config.max_programs, critical_path=self.name == "atlas"
        )
        self.calls: dict[str, CallState] = {}
        self._calls_of: dict[str, set[str]] = {}  # program -> its calls here
        self._order = itertools.count()

    program_of = staticmethod(program_of)

    def start_level(self, program: ProgramRef) -> int:
        return self.config.queue_for(self.table.service(program.program_id))

    def program_priority(self, program_id: str) -> tuple[float, ...]:
        """(queue, then the program's first arrival or, ordering by call, the call's): of its most urgent call
        here, or of its next call, which starts in its program's queue (Q1 for mlfq) after every call here."""
        by_program = self.config.order_by_program and self.program_level
        rec = self.table.get(program_id)
        first = rec.first_arrival if by_program and rec is not None and rec.first_arrival is not None else None
        calls = self._calls_of.get(program_id)
        if calls:
            return min(
                (state.level, state.arrival if first is None else first) for state in map(self.calls.__getitem__, calls)
            )
        level = self.config.queue_for(self.table.service(program_id)) if self.program_level else 0
        return (level, math.inf if first is None else first)

    # -- the policy interface ------------------------------------------------------------------

    def on_arrival(self, request: Call, now: float) -> None:
        program = self.program_of(request)
        self.table.call_arrived(program, now)  # first: a program back after its TTL starts afresh there
        level = self.start_level(program) if self.program_level else 0
        self.calls[request.request_id] = CallState(level, request.arrival_time, next(self._order), program)
        self._calls_of.setdefault(program.program_id, set()).add(request.request_id)

    def merge_remote_service(self, program: ProgramRef) -> None:
        if program.service_s is not None:
            self.table.merge_remote(
                program.program_id, program.service_s, program.waiting_s or 0.0, program.total_service_s
            )

    def update(self, now: float) -> None:
        """Promote starving calls to Q1 and expire idle programs."""
        beta = self.config.beta
        for state in self.calls.values():
            if state.level == 0:
                continue
            call_wait = max(0.0, now - state.arrival - state.service_s)
            rec = self.table.get(state.program.program_id) if self.program_level else None
            wait = call_wait + (rec.waiting_s if rec else 0.0)
            # Wait and service over the same calls: the program's waiting is summed over all its
            # calls, so its service is too (for ATLAS, not the critical path, which would make a
            # program fanning out to n threads look starved about n times sooner).
            service = state.service_s + (rec.total_service_s if rec else 0.0)
            if wait >= beta * service:
                state.level = 0
                state.level_service_s = 0.0
                state.promotions += 1
                self.table.mark_changed(state.program.program_id)
        self.table.expire_due(now)

    def priority(self, request: Call, now: float) -> tuple:
        state = self.calls.get(request.request_id)
        if state is None:
            return (self.config.num_queues, request.arrival_time, request.arrival_time, 0)
        first = state.arrival
        if self.config.order_by_program and self.program_level:
            rec = self.table.get(state.program.program_id)
            if rec is not None and rec.first_arrival is not None:
                first = rec.first_arrival
        return (state.level, first, state.arrival, state.order)

    def on_service(self, request: Call, service_s: float, now: float) -> None:
        state = self.calls.get(request.request_id)
        if state is None:
            return
        state.service_s += service_s
        state.level_service_s += service_s
        if state.level < self.config.num_queues - 1 and state.level_service_s >= self.config.quanta[state.level]:
            state.level += 1
            state.level_service_s = 0.0
            state.demotions += 1
            self.table.mark_changed(state.program.program_id)

    def on_finish(self, request: Call, now: float) -> None:
        state = self.calls.pop(request.request_id, None)
        if state is None:
            return
        calls = self._calls_of[state.program.program_id]
        calls.discard(request.request_id)
        if not calls:
            del self._calls_of[state.program.program_id]
        waiting = max(0.0, now - state.arrival - state.service_s)
        self.table.call_finished(state.program, state.service_s, waiting, now)


class MLFQPolicy(MultiLevelQueuePolicy):
    """Call-level multi-level feedback queue: every new call starts in Q1."""

    name: ClassVar[str] = "mlfq"
    program_level = False


class PLASPolicy(MultiLevelQueuePolicy):
    """Program-level attained service: a call starts in the queue of its program's total service."""

    name: ClassVar[str] = "plas"


class ATLASPolicy(MultiLevelQueuePolicy):
    """Adaptive thread-level attained service: a call starts in the queue of its program's critical path."""

    name: ClassVar[str] = "atlas"
