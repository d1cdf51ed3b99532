"""A trace of a PD run's storage links: when each was idle, and what the engines and the dispatcher were doing then.

``boundless bench agentic --trace PATH`` samples a :class:`~boundless.cluster.local_pd.LocalPDCluster` every
``SAMPLE_EVERY_S`` (:class:`PDTracer`, a thread reading counters: no lock held longer than a copy of the
dispatcher's queue) and, at the end of each PD run, :func:`idle_causes` splits each storage link's idle time by
what held it idle, checked in this order at the sample that ends each interval:

- ``loader_busy``: the engine's store loader had reads pending (a read's file reads and checksums, or the gap
  between one read's end on the link and the next's start: CPU, not the link);
- ``waiting_unread``: calls waited at the dispatcher with stored context and no read ahead (the read-ahead room
  was taken, or their read belongs to the other engine);
- ``waiting_read_ahead``: calls waited, every one with stored context already read ahead;
- ``nothing_waiting``: no call waited at the dispatcher: every stored context was read or being read, and only
  compute was left.

The samples (``timeline``: per second, each link's busy share and the queue) and the split go to the JSON.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SAMPLE_EVERY_S = 0.1
CAUSES = ("loader_busy", "waiting_unread", "waiting_read_ahead", "nothing_waiting")


@dataclass(frozen=True)
class EngineSample:
    """One engine at one sample: its storage link's cumulative busy seconds and queued bytes, its loader's
    pending reads and its scheduler's queues."""

    storage_busy_s: float
    storage_queued_bytes: int
    loader_reads_pending: int
    running: int
    waiting: int


@dataclass(frozen=True)
class TraceSample:
    """The cluster at time ``t`` (seconds since the run began)."""

    t: float
    cpu_s: float  # the process's CPU seconds so far (both cores: up to 2 s a second here)
    engines: dict[str, EngineSample]
    queued: int  # calls waiting at the dispatcher
    queued_stored: int  # of them, with stored context
    queued_unread: int  # of them, with stored context and no read ahead


@dataclass
class LinkIdle:
    """One storage link over a run: busy and idle seconds, the idle split by cause."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    idle_by_cause: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))


def cause_of(engine: EngineSample, sample: TraceSample) -> str:
    """Why ``engine``'s storage link idled at ``sample`` (the module's order)."""
    if engine.loader_reads_pending:
        return "loader_busy"
    if sample.queued_unread:
        return "waiting_unread"
    if sample.queued:
        return "waiting_read_ahead"
    return "nothing_waiting"


def idle_causes(samples: list[TraceSample]) -> dict[str, LinkIdle]:
    """Per engine with a storage link, its busy and idle seconds between the first and last sample, each
    interval's idle part given the cause seen at the sample that ends it."""
    out: dict[str, LinkIdle] = {}
    for before, after in itertools.pairwise(samples):
        dt = after.t - before.t
        for iid, eng in after.engines.items():
            prev = before.engines.get(iid)
            if prev is None or dt <= 0:
                continue
            busy = min(dt, max(0.0, eng.storage_busy_s - prev.storage_busy_s))
            link = out.setdefault(iid, LinkIdle())
            link.busy_s += busy
            link.idle_s += dt - busy
            link.idle_by_cause[cause_of(eng, after)] += dt - busy
    return out


def timeline(samples: list[TraceSample], window_s: float = 1.0) -> list[dict[str, Any]]:
    """Per ``window_s`` of the run: each link's busy share, the process's CPU (cores busy), and the dispatcher's
    queue at the window's end."""
    rows: list[dict[str, Any]] = []
    if not samples:
        return rows
    start = samples[0]
    for s in samples[1:]:
        if s.t - start.t < window_s and s is not samples[-1]:
            continue
        dt = s.t - start.t
        if dt <= 0:
            continue
        row: dict[str, Any] = {"t": round(s.t, 2), "cpu_cores": round((s.cpu_s - start.cpu_s) / dt, 2)}
        for iid, eng in s.engines.items():
            prev = start.engines.get(iid)
            if prev is not None:
                row[f"{iid}_busy"] = round(min(1.0, (eng.storage_busy_s - prev.storage_busy_s) / dt), 2)
                row[f"{iid}_loader"] = eng.loader_reads_pending
                row[f"{iid}_run_wait"] = f"{eng.running}/{eng.waiting}"
        row |= {"queued": s.queued, "queued_stored": s.queued_stored, "queued_unread": s.queued_unread}
        rows.append(row)
        start = s
    return rows


def summary(samples: list[TraceSample]) -> dict[str, Any]:
    """The JSON figure of one run: each link's idle split (seconds and shares of the run) and the timeline."""
    run_s = samples[-1].t - samples[0].t if len(samples) > 1 else 0.0
    links = {
        iid: {
            "busy_s": round(link.busy_s, 2),
            "idle_s": round(link.idle_s, 2),
            "idle_by_cause_s": {k: round(v, 2) for k, v in link.idle_by_cause.items()},
        }
        for iid, link in idle_causes(samples).items()
    }
    cpu = (samples[-1].cpu_s - samples[0].cpu_s) / run_s if run_s > 0 else 0.0
    return {"run_s": round(run_s, 2), "cpu_cores": round(cpu, 2), "links": links, "timeline": timeline(samples)}


class PDTracer:
    """Samples ``take()`` every ``every_s`` on a thread of its own between :meth:`start` and :meth:`stop`."""

    def __init__(self, take: Callable[[float], TraceSample], every_s: float = SAMPLE_EVERY_S) -> None:
        self._take = take
        self._every_s = every_s
        self._stop = threading.Event()
        self.samples: list[TraceSample] = []
        self._thread = threading.Thread(target=self._run, name="boundless-pd-trace", daemon=True)
        self._start = 0.0

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> list[TraceSample]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.samples.append(self._take(time.monotonic() - self._start))
        return self.samples

    def _run(self) -> None:
        while True:
            self.samples.append(self._take(time.monotonic() - self._start))
            if self._stop.wait(self._every_s):
                return


def cluster_sampler(pd: Any) -> Callable[[float], TraceSample]:
    """A ``take`` for a :class:`~boundless.cluster.local_pd.LocalPDCluster` ``pd``."""

    def take(t: float) -> TraceSample:
        engines = {}
        for iid, inst in pd.instances.items():
            storage = inst.links.storage
            stats = storage.stats() if storage is not None else None
            core = inst.core
            engines[iid] = EngineSample(
                storage_busy_s=stats.busy_s if stats is not None else 0.0,
                storage_queued_bytes=stats.queued_bytes if stats is not None else 0,
                loader_reads_pending=core.executor.kv_io.reads_pending,
                running=len(core.scheduler.running),
                waiting=len(core.scheduler.waiting),
            )
        with pd.lock:
            queue = [(call.stored_tokens, bool(call.prefetch_engine)) for call in pd.dispatcher.queue]
        return TraceSample(
            t=t,
            cpu_s=time.process_time(),
            engines=engines,
            queued=len(queue),
            queued_stored=sum(1 for stored, _ in queue if stored),
            queued_unread=sum(1 for stored, ahead in queue if stored and not ahead),
        )

    return take


def as_dicts(samples: list[TraceSample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in samples]
