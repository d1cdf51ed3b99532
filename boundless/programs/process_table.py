"""The process table: what the scheduler knows about each agent program (Autellix §4.1).

Per program: its attained service (for single-threaded programs, the sum of its completed calls'
model time; for multi-threaded programs, the longest critical path through its threads), its
total waiting time, per-thread records, the instances it ran on, and its last arrival and
completion. Programs idle past a TTL are dropped, and the table never holds more than
``max_programs`` entries (the least recently active idle programs go first), so memory stays
bounded however many programs come.

With ``track_changes`` on, the table also remembers which programs' records changed (arrived, finished,
dropped, merged) until :meth:`take_changed` is called: program-aware KV eviction follows them that way.

Everything here is pure bookkeeping driven by the caller's clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from boundless.programs.ref import ProgramRef

MAIN_THREAD = "main"
GAP_WINDOW = 50
# A program keeps the records of its most recently finished threads only: one living for hours with a new thread id
# per call would otherwise hold one record per call. A join naming a thread dropped here starts from its own thread.
MAX_THREADS = 1024


@dataclass
class ThreadRecord:
    """One thread of a program: a chain of calls; ``service_s`` is the critical path ending at it."""

    thread_id: str
    service_s: float = 0.0
    waiting_s: float = 0.0
    calls: int = 0


@dataclass
class ProgramRecord:
    program_id: str
    service_s: float = 0.0  # PLAS: sum over completed calls; ATLAS: longest critical path
    total_service_s: float = 0.0  # sum over completed calls, whatever the policy
    waiting_s: float = 0.0
    threads: OrderedDict[str, ThreadRecord] = field(default_factory=OrderedDict)  # least recently finished first
    instances: dict[str, int] = field(default_factory=dict)  # instance id -> calls run there
    active_calls: int = 0
    completed_calls: int = 0
    first_arrival: float | None = None  # of the first call seen here (not set by a router's merge)
    last_arrival: float = 0.0
    last_completion: float | None = None
    longest_gap_s: float = 0.0  # longest time it was idle between a call's end and its next call's arrival
    # The router's view merged since the program's last arrival here (service, summed service, waiting), or None: a
    # program back after its TTL starts afresh with it alone (:meth:`ProcessTable.call_arrived`).
    remote_view: tuple[float, float, float] | None = None

    @property
    def last_activity(self) -> float:
        return max(self.last_arrival, self.last_completion or 0.0)


# A program is dropped up to this fraction of the TTL late by :meth:`ProcessTable.expire_due` (6 s of 600 s).
EXPIRE_SCAN_FRACTION = 0.01


class ProcessTable:
    """Program records keyed by program id, bounded by a TTL and a size cap."""

    def __init__(self, ttl_s: float = 600.0, max_programs: int = 100_000, critical_path: bool = True) -> None:
        self.ttl_s = ttl_s
        self.max_programs = max_programs
        self.critical_path = critical_path  # ATLAS semantics; False sums all calls (PLAS)
        # Least recently active first (each arrival and completion moves its program to the end), so an expiry scan
        # stops at the first program active within the TTL; while the clock it is given never goes back.
        self._programs: OrderedDict[str, ProgramRecord] = OrderedDict()
        self._latest = -math.inf  # the latest time an activity was recorded at
        self._ordered = True  # whether ``_programs`` is in the order of last activity (False: a clock went back)
        self.track_changes = False
        self._changed: set[str] = set()
        # With ``track_removed`` on, the programs dropped (by the TTL or the size cap) until :meth:`take_removed`.
        self.track_removed = False
        self._removed: list[str] = []
        # The usual time programs spend idle between calls (an average over the last ~GAP_WINDOW gaps, of all
        # programs), or None before any program came back.
        self.typical_gap_s: float | None = None
        self._next_expire_scan = -math.inf  # expire_due scans no sooner

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._programs

    def get(self, program_id: str) -> ProgramRecord | None:
        return self._programs.get(program_id)

    def take_removed(self) -> list[str]:
        """The programs dropped since the last call (with ``track_removed``), oldest first; some may be back."""
        out, self._removed = self._removed, []
        return out

    def _drop(self, program_id: str) -> None:
        del self._programs[program_id]
        self.mark_changed(program_id)
        if self.track_removed:
            self._removed.append(program_id)

    def _active_at(self, program_id: str, now: float) -> None:
        """The program did something at ``now``: it goes last in the order of activity."""
        self._programs.move_to_end(program_id)
        if now < self._latest:
            self._ordered = False
        self._latest = max(self._latest, now)

    def take_changed(self) -> set[str]:
        """The programs whose records changed (or were dropped) since the last call (with ``track_changes``)."""
        out, self._changed = self._changed, set()
        return out

    def mark_changed(self, program_id: str) -> None:
        """Report a change in the program's standing that its record does not show (a call changed queue)."""
        if self.track_changes:
            self._changed.add(program_id)

    def service(self, program_id: str) -> float:
        rec = self._programs.get(program_id)
        return rec.service_s if rec else 0.0

    def call_arrived(self, program: ProgramRef, now: float) -> ProgramRecord:
        """A call of ``program`` arrived. A program back after idling past the TTL starts afresh, as it would had a
        scan dropped it first (an engine with nothing to do runs none, so its programs outlived their TTL there),
        with only the router's view merged for this call."""
        rec = self._programs.get(program.program_id)
        if rec is not None and rec.active_calls == 0 and now - rec.last_activity >= self.ttl_s:
            view = rec.remote_view
            rec = ProgramRecord(program.program_id)
            self._programs[program.program_id] = rec
            if view is not None:
                rec.service_s, rec.total_service_s, rec.waiting_s = view
        elif rec is None:
            rec = ProgramRecord(program.program_id)
            self._programs[program.program_id] = rec
        rec.remote_view = None
        if rec.first_arrival is None:
            rec.first_arrival = now
        if rec.active_calls == 0 and rec.last_completion is not None:  # back from a tool, or a user's turn
            gap = max(0.0, now - rec.last_completion)
            rec.longest_gap_s = max(rec.longest_gap_s, gap)
            typical = self.typical_gap_s
            self.typical_gap_s = gap if typical is None else typical + (gap - typical) / GAP_WINDOW
        self._active_at(program.program_id, now)
        rec.active_calls += 1
        rec.last_arrival = now
        self.mark_changed(program.program_id)
        self._evict(now)
        return rec

    def call_finished(
        self, program: ProgramRef, service_s: float, waiting_s: float, now: float, instance: str | None = None
    ) -> ProgramRecord | None:
        """Record a completed call: its model time and the time it waited."""
        rec = self._programs.get(program.program_id)
        if rec is None:  # dropped meanwhile (TTL); start afresh
            rec = self.call_arrived(program, now)
        rec.active_calls = max(0, rec.active_calls - 1)
        rec.completed_calls += 1
        rec.total_service_s += service_s
        rec.waiting_s += waiting_s
        rec.last_completion = now
        if instance is not None:
            rec.instances[instance] = rec.instances.get(instance, 0) + 1
        thread_id = program.thread_id or MAIN_THREAD
        thread = rec.threads.setdefault(thread_id, ThreadRecord(thread_id))
        rec.threads.move_to_end(thread_id)
        if len(rec.threads) > MAX_THREADS:
            rec.threads.popitem(last=False)
        # The call started where its longest predecessor path ended: its own thread's previous calls
        # or any parent thread it joins (a DAG).
        start = thread.service_s
        if program.parent_thread_ids:
            start = max([start] + [rec.threads[p].service_s for p in program.parent_thread_ids if p in rec.threads])
        thread.service_s = start + service_s
        thread.waiting_s += waiting_s
        thread.calls += 1
        if self.critical_path:
            rec.service_s = max(rec.service_s, thread.service_s)
        else:
            rec.service_s = rec.total_service_s
        self._active_at(program.program_id, now)
        self.mark_changed(program.program_id)
        return rec

    def call_abandoned(self, program_id: str) -> None:
        """A call that arrived but will not complete (rejected, aborted, lost): it stops keeping its
        program active, so the program can still expire. Its service, if any, is not counted."""
        rec = self._programs.get(program_id)
        if rec is not None:
            rec.active_calls = max(0, rec.active_calls - 1)
            self.mark_changed(program_id)

    def merge_remote(
        self, program_id: str, service_s: float, waiting_s: float, total_service_s: float | None = None
    ) -> None:
        """Adopt a global view (from a router) of a program's service and waiting, never going back.

        Without the router's summed service, the critical path stands in for it (a lower bound):
        the starvation check divides summed wait by summed service, and a local sum alone would
        make a program that ran elsewhere look starved at once."""
        rec = self._programs.get(program_id)
        if rec is None:  # no activity here yet: first in the order of activity
            rec = ProgramRecord(program_id)
            self._programs[program_id] = rec
            self._programs.move_to_end(program_id, last=False)
        total = service_s if total_service_s is None else total_service_s
        rec.service_s = max(rec.service_s, service_s)
        rec.total_service_s = max(rec.total_service_s, total)
        rec.waiting_s = max(rec.waiting_s, waiting_s)
        rec.remote_view = (service_s, total, waiting_s)
        self.mark_changed(program_id)

    def expire_due(self, now: float) -> list[str]:
        """:meth:`expire`, at most once per :data:`EXPIRE_SCAN_FRACTION` of the TTL: the engine's policy asks
        every step, and a scan passes over every program (the simulator's hottest line at 16 instances)."""
        if now < self._next_expire_scan:
            return []
        self._next_expire_scan = now + self.ttl_s * EXPIRE_SCAN_FRACTION
        return self.expire(now)

    def expire(self, now: float) -> list[str]:
        """Drop programs with no active call and no activity for ``ttl_s``; returns their ids.

        The scan goes in the order of activity and stops at the first program active within the TTL (those after it
        are too): a cluster's table holds the programs of the last TTL (tens of thousands, at a simulated 1,152 GPUs),
        and its dispatcher expires at every heartbeat."""
        dropped = []
        for pid, rec in self._programs.items():
            if now - rec.last_activity < self.ttl_s:
                if self._ordered:
                    break
            elif rec.active_calls == 0:
                dropped.append(pid)
        for pid in dropped:
            self._drop(pid)
        return dropped

    def _evict(self, now: float) -> None:
        if len(self._programs) <= self.max_programs:
            return
        self.expire(now)
        # Still too many: drop the least recently active idle programs. The scan stops once it has found enough: at
        # the cap every new program comes here, and a pass over (a copy of) every record made each arrival cost
        # milliseconds to over 100 ms at the default cap (100,000), the engine's or the router's thread stalled with it.
        excess = len(self._programs) - self.max_programs
        if excess <= 0:
            return
        idle: list[str] = []
        for pid, rec in self._programs.items():
            if rec.active_calls == 0:
                idle.append(pid)
                if len(idle) >= excess:
                    break
        for pid in idle:
            self._drop(pid)
