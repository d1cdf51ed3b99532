"""The cluster's watchdog over its engines' steps: a step older than ``--step-timeout-s`` makes its instance lost, a
younger one does not, and an idle engine (no step in flight) never is."""

from __future__ import annotations

import pytest

from boundless.cluster.stuck_step import stuck_step
from boundless.config import ClusterConfig, ConfigError
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.engine.step_watch import StepReport, StepWatch


def test_a_step_younger_than_the_limit_is_fine_and_an_older_one_is_lost() -> None:
    assert stuck_step(StepReport(119.0, 3, 48), 120.0) is None
    assert stuck_step(StepReport(120.0, 3, 48), 120.0) is None
    reason = stuck_step(StepReport(130.2, 3, 48), 120.0)
    assert reason == "step running 130 s (limit 120 s; 3 requests, 48 tokens)"
    assert "4 passes" in (stuck_step(StepReport(5.0, 2, 2, passes=4), 1.5) or "")


def test_an_idle_engine_is_never_lost_however_long_it_idles() -> None:
    now = [0.0]
    watch = StepWatch(lambda: now[0])
    assert stuck_step(watch.report(), 1.0) is None
    chunk = ScheduledChunk("a", [1, 2, 3], 0, [0], True, None, 0, ())  # type: ignore[arg-type]
    watch.begin(SchedulerOutput(chunks=[chunk]))
    now[0] = 0.5
    assert watch.report() == StepReport(0.5, 1, 3)
    assert stuck_step(watch.report(), 1.0) is None
    now[0] = 2.0
    assert stuck_step(watch.report(), 1.0) is not None  # stuck in the step
    watch.end()
    now[0] = 1e9  # idle ever since
    assert watch.report() is None
    assert stuck_step(watch.report(), 1.0) is None


def test_the_step_timeout_must_be_positive() -> None:
    assert ClusterConfig().step_timeout_s == 120.0
    with pytest.raises(ConfigError, match="--step-timeout-s: must be positive"):
        ClusterConfig(step_timeout_s=0)
