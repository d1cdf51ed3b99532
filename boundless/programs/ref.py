"""Which agent program a call belongs to, as a request carries it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProgramRef:
    """Which agent program and thread a call belongs to (Autellix). A call without one is a program of its own.

    A router may attach its global view of the program (``service_s``, ``total_service_s``,
    ``waiting_s``) so that an instance's priorities reflect service the program received on other
    instances.
    """

    program_id: str
    thread_id: str | None = None
    parent_thread_ids: tuple[str, ...] = ()
    service_s: float | None = None  # the policy's measure: the sum (PLAS) or critical path (ATLAS)
    total_service_s: float | None = None  # the sum over completed calls, whatever the policy
    waiting_s: float | None = None
