"""An executor whose forward pass hangs: the injected fault for an engine stuck inside a step (a kernel that never
returns, a deadlocked collective), for the step watchdog's tests and the cluster instance's ``HANG_STEP_ENV``
test hook (``cluster/instance.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from boundless.engine.scheduler import SchedulerOutput


class HangTrap:
    """Springs once, on the first step ``catches`` (of any executor sharing the trap); the step it caught hangs
    until :meth:`release`."""

    def __init__(self, catches: Callable[[SchedulerOutput], bool]) -> None:
        self.catches = catches
        self.sprung = threading.Event()
        self.caught_by = ""  # the name of the executor whose step it caught
        self._released = threading.Event()
        self._lock = threading.Lock()

    def springs(self, sched: SchedulerOutput, name: str = "") -> bool:
        with self._lock:
            if self.sprung.is_set() or not self.catches(sched):
                return False
            self.caught_by = name
            self.sprung.set()
            return True

    def hold(self) -> None:
        self._released.wait()

    def release(self) -> None:
        self._released.set()


class HungExecutor:
    """Runs ``inner``'s steps, except that the step ``trap`` catches hangs before its forward pass; everything else
    is ``inner``'s. ``name`` tells the trap whose step it caught."""

    def __init__(self, inner: Any, trap: HangTrap, name: str = "") -> None:
        self.inner = inner
        self.trap = trap
        self.name = name

    def execute(self, sched: SchedulerOutput) -> Any:
        if self.trap.springs(sched, self.name):
            self.trap.hold()
        return self.inner.execute(sched)

    def launch(self, sched: SchedulerOutput, follows: Any = None) -> Any:
        if self.trap.springs(sched, self.name):
            self.trap.hold()
        return self.inner.launch(sched, follows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
