"""Emulated links: an instance's storage NIC and compute-network NIC, with DualPath's traffic isolation.

On one machine every instance reads one disk and talks over loopback, so neither the storage
bottleneck nor the compute network of a real cluster exists. A :class:`Link` puts them back: each
instance gets a storage link (``--storage-gbps``) and a network link (``--net-gbps``) that carry
bytes at their rate, and real reads and transfers wait for their bytes to cross it.

A link is a token bucket without burst: it carries bytes at exactly ``bytes_per_s`` and hands its
capacity out one *chunk* at a time. Transfers wait in two classes (:class:`Traffic`): model traffic
(activations, attention partials) and KV traffic (KV reads, KV handoffs). At every chunk boundary
the next chunk goes to the oldest model transfer, so a model transfer waits at most one chunk behind
a KV transfer already on the wire (the paper's traffic isolation, DualPath section 4.2.1: forward
communication in a high-priority virtual lane). As the paper reserves ~1% of the link for the
low-priority lane so KV traffic is never starved, one chunk in ``round(1 / kv_share)`` goes to KV
traffic while both classes wait (``kv_share=0``: strict priority). Within a class, FIFO.

The link is plain state over times it is given, so one class serves two drivers:

- **virtual time** (the simulator, #15): :meth:`Link.submit` a transfer of N bytes at time t;
  :meth:`Link.estimated_finish` says when it ends if nothing else arrives, :meth:`Link.next_finish`
  when the link's next transfer ends, and :meth:`Link.advance` moves the link to a time and returns
  the transfers done by then. Schedules do not depend on how often the link is advanced.
- **threads** (real reads and transfers): :class:`ThrottledLink` wraps a link with a lock, an
  injected clock and an injected sleep; :meth:`ThrottledLink.transfer` blocks until the bytes have
  crossed. Tests give it a virtual clock whose sleep moves time, so they run in no wall time.

Counters per link (:class:`LinkStats`): bytes carried per class, bytes queued per class (the storage
link's queue is the node's *read queue* of the inter-engine scheduler), busy seconds.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from boundless.config import ClusterConfig


class Traffic(IntEnum):
    """Traffic classes, first served first: model traffic is latency-critical, KV traffic fills the rest."""

    MODEL = 0
    KV = 1


# A chunk is the unit the link hands out: small enough that model traffic waits little behind KV
# traffic on the wire (256 KiB at 10 Gbit/s is 0.2 ms, under one decode step anywhere), large enough
# that a GB-sized read is a few thousand decisions, computed in bulk between arrivals anyway.
DEFAULT_CHUNK_BYTES = 256 * 1024
# The paper's virtual-lane arbiter gives the high-priority lane ~99% of the link when both are busy.
DEFAULT_KV_SHARE = 0.01


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Gbit/s (decimal, as NICs are rated) to bytes per second."""
    return gbps * 1e9 / 8


@dataclass
class Transfer:
    """One transfer over a link. ``finished_at`` is set once its last chunk is scheduled; the link
    reports it done (:meth:`Link.advance`) once that time has come."""

    transfer_id: int
    nbytes: int
    traffic: Traffic
    submitted_at: float
    remaining: int  # bytes not yet scheduled on the wire
    finished_at: float | None = None


@dataclass
class LinkStats:
    """A link's counters at a time: bytes carried and bytes still to cross, per traffic class
    (``model``, ``kv``), and the seconds it spent carrying bytes."""

    name: str
    bytes_per_s: float
    bytes_carried: dict[str, int] = field(default_factory=dict)
    bytes_queued: dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0
    transfers_done: int = 0

    @property
    def queued_bytes(self) -> int:
        return sum(self.bytes_queued.values())


class Link:
    """A link of ``bytes_per_s`` shared by transfers in two traffic classes (see the module docstring).

    Time is whatever the caller passes, non-decreasing. The link keeps the current busy period's start
    and the bytes scheduled in it, so every finish time is ``start + bytes / rate``: the same however
    the caller splits its calls to :meth:`advance`.
    """

    def __init__(
        self,
        name: str,
        bytes_per_s: float,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        kv_share: float = DEFAULT_KV_SHARE,
    ) -> None:
        if bytes_per_s <= 0 or chunk_bytes <= 0 or not 0 <= kv_share <= 0.5:
            raise ValueError("a link needs a positive rate and chunk, and a KV share in [0, 0.5]")
        self.name = name
        self.bytes_per_s = bytes_per_s
        self.chunk_bytes = chunk_bytes
        # While both classes wait, model traffic takes turn - 1 chunks in a row, then KV traffic one.
        self._turn = round(1 / kv_share) if kv_share > 0 else 0
        self._waiting: dict[Traffic, deque[Transfer]] = {t: deque() for t in Traffic}
        self._scheduled: list[Transfer] = []  # fully on the wire, not yet reported done
        self._period_start = 0.0  # when the current busy period began
        self._period_bytes = 0  # bytes scheduled since then
        self._model_run = 0  # model chunks in a row while KV traffic waited
        self._now = -math.inf
        self._next_id = 0
        self._carried = {t: 0 for t in Traffic}
        self._scheduled_busy_s = 0.0
        self._segments: list[tuple[float, float, Traffic]] = []  # (start, end, class) of chunks scheduled lately
        self._done = 0

    # -- virtual time ----------------------------------------------------------------------------

    def submit(self, nbytes: int, now: float, traffic: Traffic = Traffic.KV) -> Transfer:
        """A transfer of ``nbytes`` arrives at ``now``; it waits its turn behind the link's earlier work."""
        if nbytes < 0:
            raise ValueError("a transfer cannot carry negative bytes")
        self.advance(now)
        transfer = Transfer(self._next_id, nbytes, traffic, now, nbytes)
        self._next_id += 1
        if not self._busy(now):
            self._period_start, self._period_bytes = now, 0  # an idle link starts a new busy period
        if nbytes == 0:
            transfer.finished_at = now
            self._scheduled.append(transfer)
        else:
            self._waiting[traffic].append(transfer)
        return transfer

    def advance(self, now: float) -> list[Transfer]:
        """Move the link to ``now``: schedule every chunk that starts before it; return the transfers
        whose last byte has crossed by ``now``, in finishing order."""
        if now < self._now:
            raise ValueError(f"link {self.name}: time went back from {self._now} to {now}")
        self._now = now
        self._schedule_until(now)
        done = sorted((t for t in self._scheduled if t.finished_at <= now), key=lambda t: t.finished_at)  # type: ignore[operator]
        for t in done:
            self._scheduled.remove(t)
            self._done += 1
        self._segments = [seg for seg in self._segments if seg[1] > now]
        return done

    def estimated_finish(self, transfer: Transfer) -> float:
        """When ``transfer`` ends if nothing else arrives (later model traffic can only delay it)."""
        if transfer.finished_at is not None:
            return transfer.finished_at
        return next(t.finished_at for t in self._scheduled_ahead() if t.transfer_id == transfer.transfer_id)  # type: ignore[return-value]

    def next_finish(self) -> float | None:
        """When the link's next transfer ends if nothing else arrives; None when it carries nothing."""
        return min((t.finished_at for t in self._scheduled_ahead() if t.finished_at is not None), default=None)

    def stats(self) -> LinkStats:
        """The counters as of the last time the link was moved to."""
        now = self._now
        self._segments = [seg for seg in self._segments if seg[1] > now]
        queued = {t: sum(x.remaining for x in self._waiting[t]) for t in Traffic}
        carried = dict(self._carried)
        ahead_s = 0.0
        for start, end, traffic in self._segments:  # scheduled on the wire, not yet crossed
            seconds = end - max(start, now)
            part = min(round(seconds * self.bytes_per_s), carried[traffic])
            queued[traffic] += part
            carried[traffic] -= part
            ahead_s += seconds
        return LinkStats(
            name=self.name,
            bytes_per_s=self.bytes_per_s,
            bytes_carried={t.name.lower(): b for t, b in carried.items()},
            bytes_queued={t.name.lower(): b for t, b in queued.items()},
            busy_s=self._scheduled_busy_s - ahead_s,
            transfers_done=self._done,
        )

    # -- the schedule ----------------------------------------------------------------------------

    def _has_waiting(self) -> bool:
        return any(self._waiting.values())

    def _busy(self, now: float) -> bool:
        return self._has_waiting() or self._wire_free_at() > now

    def _wire_free_at(self) -> float:
        return self._period_start + self._period_bytes / self.bytes_per_s

    def _schedule_until(self, now: float) -> None:
        while self._has_waiting() and self._wire_free_at() < now:
            self._schedule_chunks(now)

    def _scheduled_ahead(self) -> list[Transfer]:
        """Every transfer not yet reported, scheduled to its end on a copy of the link (nothing arriving)."""
        if not self._has_waiting():
            return self._scheduled
        ahead = copy.deepcopy(self)
        ahead._schedule_until(math.inf)
        return ahead._scheduled

    def _next_in_line(self) -> tuple[Transfer, float]:
        """The transfer the next chunk goes to, and how many chunks in a row it may take."""
        model, kv = self._waiting[Traffic.MODEL], self._waiting[Traffic.KV]
        if not model:
            self._model_run = 0
            return kv[0], math.inf
        if not kv or not self._turn:
            return model[0], math.inf
        if self._model_run >= self._turn - 1:
            return kv[0], 1
        return model[0], self._turn - 1 - self._model_run

    def _chunks_starting_before(self, now: float) -> float:
        """How many chunks can start before ``now`` from the wire's free time (at least one)."""
        if now == math.inf:
            return math.inf
        rate, chunk, start, offset = self.bytes_per_s, self.chunk_bytes, self._period_start, self._period_bytes
        n = max(1, math.ceil(((now - start) * rate - offset) / chunk))
        # The estimate may be off by one in floating point: settle it with the exact test used for finish times.
        while n > 1 and start + (offset + (n - 1) * chunk) / rate >= now:
            n -= 1
        while start + (offset + n * chunk) / rate < now:
            n += 1
        return n

    def _schedule_chunks(self, now: float) -> None:
        transfer, max_run = self._next_in_line()
        start = self._wire_free_at()
        n = min(self._chunks_starting_before(now), max_run)
        needed = math.ceil(transfer.remaining / self.chunk_bytes)
        served = transfer.remaining if n >= needed else int(n) * self.chunk_bytes
        used = needed if n >= needed else int(n)
        if transfer.traffic == Traffic.MODEL and self._waiting[Traffic.KV]:
            self._model_run += used
        elif transfer.traffic == Traffic.KV:
            self._model_run = 0
        transfer.remaining -= served
        self._period_bytes += served
        self._carried[transfer.traffic] += served
        self._scheduled_busy_s += served / self.bytes_per_s
        self._segments.append((start, self._wire_free_at(), transfer.traffic))
        if transfer.remaining == 0:
            self._waiting[transfer.traffic].popleft()
            transfer.finished_at = self._wire_free_at()
            self._scheduled.append(transfer)


Clock = Callable[[], float]
Sleep = Callable[[float], None]


class ThrottledLink:
    """A :class:`Link` for threads: :meth:`transfer` blocks the caller until its bytes have crossed.

    A real read or transfer calls it for its byte count (before using the bytes: they have arrived
    when it returns). The clock and the sleep are injected: ``time.monotonic`` and ``time.sleep``
    in serving, a virtual clock in tests.
    """

    def __init__(self, link: Link, clock: Clock, sleep: Sleep) -> None:
        self.link = link
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._waiting_to_start = 0  # bytes of reads queued at the node's loader, not yet on the link (announce)

    def transfer(self, nbytes: int, traffic: Traffic = Traffic.KV) -> float:
        """Wait until ``nbytes`` have crossed the link; returns the seconds waited."""
        with self._lock:
            start = self.clock()
            t = self.link.submit(nbytes, start, traffic)
        return self._wait_for(t) - start

    def announce(self, nbytes: int) -> None:
        """``nbytes`` (a read handed to the node's store loader) will be queued on the link when the loader starts
        the read; until then they count in the link's queue (``bytes_queued["waiting"]``): the node's read queue
        the PD scheduler balances is every read the node has yet to carry, not only the one in progress. Negative:
        the loader started (or dropped) the read."""
        with self._lock:
            self._waiting_to_start = max(0, self._waiting_to_start + nbytes)

    def begin(self, nbytes: int, traffic: Traffic = Traffic.KV) -> Callable[[], float]:
        """Queue ``nbytes`` on the link now and return a wait for them: calling it blocks until they have crossed
        and returns the seconds since they were queued. A storage read queues its bytes before it reads its files,
        so the file reads (CPU: system calls, checksums) run while the link carries the bytes, as a NIC streams a
        read while the host takes in what has arrived, instead of the link idling during them."""
        with self._lock:
            start = self.clock()
            t = self.link.submit(nbytes, start, traffic)
        return lambda: self._wait_for(t) - start

    def _wait_for(self, t: Transfer) -> float:
        """Sleep until ``t`` has crossed; returns the clock then."""
        while True:
            with self._lock:
                now = self.clock()
                self.link.advance(now)
                if t.finished_at is not None and t.finished_at <= now:
                    return now
                # A wake-up no later than the finish: later model traffic can only push it back.
                wake = self.link.estimated_finish(t)
            self.sleep(max(0.0, wake - now))

    def transfer_parts(
        self, sizes: Sequence[int], on_part: Callable[[int], None], traffic: Traffic = Traffic.KV
    ) -> float:
        """Send ``sizes`` back to back as one queue entry each, all queued at once (the link's queue shows their sum,
        as for one transfer), calling ``on_part(i)`` as part ``i`` has crossed; returns the seconds waited. A load
        carried layer by layer: each layer is usable as soon as it has arrived (``kv/layer_gate.py``)."""
        with self._lock:
            start = self.clock()
            parts = [self.link.submit(n, start, traffic) for n in sizes]
        end = start
        for i, t in enumerate(parts):
            end = self._wait_for(t)
            on_part(i)
        return end - start

    def stats(self) -> LinkStats:
        with self._lock:
            self.link.advance(self.clock())
            stats = self.link.stats()
            if self._waiting_to_start:
                stats.bytes_queued["waiting"] = self._waiting_to_start
            return stats


@dataclass
class InstanceLinks:
    """An instance's emulated links; None where the flag is unset (no limit)."""

    storage: ThrottledLink | None
    net: ThrottledLink | None

    def stats(self) -> list[LinkStats]:
        return [link.stats() for link in (self.storage, self.net) if link is not None]


def instance_links(config: ClusterConfig, clock: Clock, sleep: Sleep) -> InstanceLinks:
    """The storage and network links of one instance, from ``--storage-gbps`` and ``--net-gbps``."""

    def make(name: str, gbps: float | None) -> ThrottledLink | None:
        return None if gbps is None else ThrottledLink(Link(name, gbps_to_bytes_per_s(gbps)), clock, sleep)

    return InstanceLinks(storage=make("storage", config.storage_gbps), net=make("net", config.net_gbps))
