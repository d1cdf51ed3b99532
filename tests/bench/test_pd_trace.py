"""The PD trace's idle split: each storage link's idle time given the cause seen at the end of its interval."""

from __future__ import annotations

import pytest

from boundless.bench.pd_trace import EngineSample, TraceSample, idle_causes, summary


def _sample(t: float, busy: float, loader: int = 0, queued: int = 0, unread: int = 0) -> TraceSample:
    engine = EngineSample(storage_busy_s=busy, storage_queued_bytes=0, loader_reads_pending=loader, running=0,
                          waiting=0)  # fmt: skip
    return TraceSample(t, cpu_s=t, engines={"p0": engine}, queued=queued, queued_stored=unread, queued_unread=unread)


def test_idle_time_goes_to_the_cause_seen_when_the_link_idled() -> None:
    samples = [
        _sample(0.0, 0.0),
        _sample(1.0, 1.0, loader=1, queued=3, unread=2),  # busy the whole second
        _sample(2.0, 1.5, loader=1, queued=3, unread=2),  # half idle, the loader reading files
        _sample(3.0, 1.5, queued=2, unread=2),  # idle: calls wait unread
        _sample(4.0, 1.5, queued=1),  # idle: a call waits, read ahead already
        _sample(5.0, 1.5),  # idle: nothing waits
    ]
    link = idle_causes(samples)["p0"]
    assert link.busy_s == 1.5 and link.idle_s == 3.5
    assert link.idle_by_cause == {"loader_busy": 0.5, "waiting_unread": 1.0, "waiting_read_ahead": 1.0,
                                  "nothing_waiting": 1.0}  # fmt: skip
    out = summary(samples)
    assert out["run_s"] == 5.0 and out["cpu_cores"] == 1.0
    assert [row["p0_busy"] for row in out["timeline"]] == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
