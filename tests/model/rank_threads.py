"""Ranks of a split model run side by side as threads of the test's process (each rank's sum meets the others' as it
would across processes), for the tests of ``model/tensor_parallel.py`` and ``model/shared_memory_sum.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_threads(size: int, rank_body: Callable[[int], T], timeout_s: float = 120) -> list[T]:
    """``rank_body(rank)`` for each of ``size`` ranks, each in a thread of its own, all at once; their results in rank
    order. An exception in any is raised here (as an assertion naming them all)."""
    out: list[T | None] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = rank_body(rank)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"a rank ran past {timeout_s} s"
    return [r for r in out if r is not None]
