"""Where the engine's host is during a run: each call of its phases (deciding a step, launching it, waiting for a
window on the device, applying its tokens) as an interval on the host's clock. Summed, they split a run's wall time
(``bench gpu``'s ``host_split``); laid against the GPU's idle gaps, they say what the host was doing while the GPU
waited (``kernel_busy_fraction``'s ``idle_gaps_host``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from boundless.engine.scheduler import SchedulerOutput

# The split's names of the engine's calls: ``wait`` is inside ``execute`` (a window's read-back).
# ``decode_pending`` (text decoded while the device runs a window queued ahead) counts as applying tokens.
SPLIT_NAMES = {
    "schedule": "schedule",
    "schedule_ahead": "schedule",
    "launch": "execute",
    "wait": "execute",
    "decode_pending": "finish_step",
}


@dataclass(frozen=True)
class Phase:
    """One call of an engine phase: ``name`` (``schedule``, ``schedule_ahead``, ``launch``, ``wait``,
    ``finish_step``, ``decode_pending``), its interval on ``time.perf_counter_ns``'s clock, and the step it was for
    (``step_shape``)."""

    name: str
    start_ns: int
    end_ns: int
    step: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} ({self.step})" if self.step else self.name


def step_shape(sched: SchedulerOutput) -> str:
    """A step in a few words: its prefill tokens and decodes, a window's passes, whether it was decided ahead."""
    chunks = sched.chunks
    decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
    prefill = sum(len(c.token_ids) for c in chunks) - decodes
    parts = [f"{prefill} prefill tokens"] if prefill else []
    if decodes:
        parts.append(
            f"{decodes} decode{'s' if decodes > 1 else ''}" + (f" x {sched.window}" if sched.window > 1 else "")
        )
    return ", ".join(parts) + (", ahead" if sched.decided_ahead else "")


class PhaseRecorder:
    """Records the phases of an ``EngineCore``'s calls while open (``with PhaseRecorder(core) as phases``): its
    methods wrapped on the instance, the class's put back at the end."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.phases: list[Phase] = []  # filled when the block ends
        # (name, start, end, the step): its shape is put in words after the run, not in the time measured.
        self._calls: list[tuple[str, int, int, SchedulerOutput | None]] = []

    def _timed(self, name: str, fn: Callable[..., Any], step: Callable[..., Any] | None = None) -> Callable[..., Any]:
        calls = self._calls

        def wrapper(*a: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*a)
            finally:
                calls.append((name, start, time.perf_counter_ns(), step(*a) if step is not None else None))

        return wrapper

    def __enter__(self) -> list[Phase]:
        core = self.core
        launch_step = self._timed("launch", core.launch, lambda sched, *_: sched)

        def launch(*a: Any) -> Any:
            launched = launch_step(*a)
            launched.wait = self._timed("wait", launched.wait, lambda: launched.sched)
            return launched

        self._patches = {
            "schedule": self._timed("schedule", core.schedule),
            "schedule_ahead": self._timed("schedule_ahead", core.schedule_ahead, lambda sched, _: sched),
            "launch": launch,
            "finish_step": self._timed("finish_step", core.finish_step, lambda sched, _: sched),
            "decode_pending": self._timed("decode_pending", core.decode_pending, lambda queued: queued),
        }
        for name, fn in self._patches.items():
            setattr(core, name, fn)
        return self.phases

    def __exit__(self, *exc: object) -> None:
        for name in self._patches:
            delattr(self.core, name)  # the class's methods again
        self.phases.extend(
            Phase(name, start, end, step_shape(sched) if sched is not None else "")
            for name, start, end, sched in self._calls
        )


def split(phases: list[Phase], wall_s: float, steps: int) -> dict[str, Any]:
    """A run's wall time split among the phases: ``schedule`` (deciding, ahead too), ``execute`` (launching and
    waiting for the device; ``wait`` is that wait alone), ``finish_step``, and ``other`` (the rest of the run);
    seconds in all, and milliseconds per step."""
    spent = {"schedule": 0.0, "execute": 0.0, "finish_step": 0.0, "wait": 0.0}
    for p in phases:
        seconds = (p.end_ns - p.start_ns) / 1e9
        spent[SPLIT_NAMES.get(p.name, p.name)] += seconds
        if p.name == "wait":
            spent["wait"] += seconds
    out: dict[str, Any] = {"wall_s": wall_s, "steps": steps}
    for name, seconds in spent.items():
        out[f"{name}_s"] = seconds
        out[f"{name}_ms_per_step"] = 1e3 * seconds / max(steps, 1)
    out["other_s"] = wall_s - sum(v for k, v in spent.items() if k != "wait")
    return out


def overlaps(lo: int, hi: int, phases: list[Phase], offset_ns: int = 0) -> dict[str, float]:
    """Milliseconds of ``[lo, hi)`` (ns, the GPU's clock) that each phase (by label) covered, the phases' host times
    moved by ``offset_ns`` onto that clock; ``outside the engine's phases``: the rest (``generate``'s own work around
    the steps). Nested phases (a wait in a launch) each count."""
    found: dict[str, float] = {}
    covered: list[tuple[int, int]] = []
    for p in phases:
        a, b = max(lo, p.start_ns + offset_ns), min(hi, p.end_ns + offset_ns)
        if b > a:
            found[p.label] = found.get(p.label, 0.0) + (b - a) / 1e6
            covered.append((a, b))
    union, end = 0, lo
    for a, b in sorted(covered):
        a = max(a, end)
        if b > a:
            union += b - a
            end = b
    rest = (hi - lo - union) / 1e6
    if rest > 0:
        found["outside the engine's phases"] = rest
    return {k: round(v, 3) for k, v in sorted(found.items(), key=lambda kv: -kv[1])}


def gaps_by_phase(
    gaps: list[tuple[int, int]], first_ns: int, phases: list[Phase], offset_ns: int, limit: int = 5
) -> list[dict[str, Any]]:
    """The ``limit`` longest of the GPU's idle gaps (``merge_spans``'s: ns idle, ns after ``first_ns``, the first
    activity, on the GPU's clock), each with what the host was doing meanwhile (:func:`overlaps`)."""
    return [
        {"ms": round(g / 1e6, 2), "at_ms": round(at / 1e6, 1),
         "host": overlaps(first_ns + at, first_ns + at + g, phases, offset_ns)}
        for g, at in sorted(gaps, reverse=True)[:limit]
    ]  # fmt: skip
