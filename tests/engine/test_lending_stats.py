"""Lending figures of several instances taken as one."""

from __future__ import annotations

import dataclasses

from boundless.engine.lending_stats import LendingStats


def test_the_total_of_instances_sums_every_field() -> None:
    fields = [f.name for f in dataclasses.fields(LendingStats)]
    a = LendingStats(**{name: i + 1 for i, name in enumerate(fields)})
    b = dataclasses.replace(a, moves_out=10, exposed_wait_s=0.25, blocks_borrowed=0)
    total = LendingStats.total([a, b, LendingStats()])
    assert total == LendingStats(**{name: getattr(a, name) + getattr(b, name) for name in fields})
    assert LendingStats.total([]) == LendingStats()
