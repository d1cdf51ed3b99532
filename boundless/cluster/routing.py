"""Which instance serves a call (Autellix §4.3, data-locality-aware load balancing).

Calls of up to ``locality_threshold`` tokens go to the least-loaded live instance: for short calls
the shared system prompt is most of the input, and any instance has it cached. Among the least loaded, a
short call goes to its program's home when that is one of them: the balance is the same either way, and
the conversation so far is cached there (the rest of the prompt would be computed again anywhere else;
SGLang's cache-aware router prefers the cached instance while loads are balanced). Longer calls go
to the instance that holds their program's KV (its "home": where its last call ran, so the
conversation so far is a prefix-cache hit there), unless that instance has more than
``max_imbalance`` calls beyond the least-loaded one: then queueing would cost more than
recomputing the prefix (SGLang's cache-aware router makes the same trade). ``round-robin`` and
``least-loaded`` exist for comparison. Pure: decisions depend only on the views passed in and the
router's own small state.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Container, Iterable
from dataclasses import dataclass

from mypy_extensions import mypyc_attr


@dataclass
class InstanceView:
    """What the router knows of an instance: whether it lives (from heartbeats) and its load.

    The load is the router's own count of calls it sent there that have not finished. Every
    call reaches an instance through the router, so the count is exact and current; the
    heartbeat's running and waiting counts say the same thing up to a heartbeat late, and a late
    count would steer calls away from an instance that has long gone idle.
    """

    instance_id: str
    alive: bool = True
    inflight: int = 0

    @property
    def load(self) -> int:
        return self.inflight


@mypyc_attr(native_class=False)  # (compiled, a class that derives from RuntimeError must stay a Python class)
class NoLiveInstanceError(RuntimeError):
    pass


class LoadIndex:
    """The live views filed by load, each load's views in the views' order: the least loaded instances without a
    pass over every view (a simulated cluster routes over a thousand instances per call).

    Whoever changes a view's load or liveness calls :meth:`update` for it (the dispatcher does, for its views).
    """

    def __init__(self, views: Iterable[InstanceView]) -> None:
        self.views = list(views)
        self._position = {v.instance_id: k for k, v in enumerate(self.views)}
        self._by_load: dict[int, list[int]] = {}  # load -> the positions of the live views with it, ascending
        self._filed: dict[int, int] = {}  # position -> the load it is filed under (live views only)
        for k in range(len(self.views)):
            self._file(k)

    def update(self, instance_id: str) -> None:
        """Refile the view of ``instance_id`` after its load or liveness changed."""
        k = self._position[instance_id]
        load = self._filed.pop(k, None)
        if load is not None:
            bucket = self._by_load[load]
            del bucket[bisect_left(bucket, k)]
            if not bucket:
                del self._by_load[load]
        self._file(k)

    def _file(self, k: int) -> None:
        view = self.views[k]
        if view.alive:
            insort(self._by_load.setdefault(view.load, []), k)
            self._filed[k] = view.load

    @property
    def num_live(self) -> int:
        return len(self._filed)

    def least_loaded(self) -> list[int]:
        """The positions of the live views with the lowest load, in the views' order (at least one live view)."""
        return self._by_load[min(self._by_load)]

    def live_view(self, instance_id: str) -> InstanceView | None:
        """The view of ``instance_id`` if it is one of these and alive."""
        k = self._position.get(instance_id)
        return self.views[k] if k is not None and k in self._filed else None


class Router:
    def __init__(self, routing: str = "locality", locality_threshold: int = 2048, max_imbalance: int = 4) -> None:
        self.routing = routing
        self.locality_threshold = locality_threshold
        self.max_imbalance = max_imbalance
        self.homes: dict[str, str] = {}  # program id -> instance of its last call (holding its KV)
        self._next = 0

    def choose(
        self, views: Iterable[InstanceView], program_id: str | None, num_tokens: int, index: LoadIndex | None = None
    ) -> str:
        """The instance for a call of ``num_tokens`` tokens. ``index``, when given, files ``views`` by load as they are
        now (the dispatcher keeps one current); without it one is built from ``views``."""
        index = index if index is not None else LoadIndex(views)
        if not index.num_live:
            raise NoLiveInstanceError("no live engine instance")
        if self.routing == "round-robin":
            live = [v for v in index.views if v.alive]
            choice = live[self._next % len(live)]
            self._next += 1
            return choice.instance_id
        ties = index.least_loaded()
        least = index.views[ties[self._next % len(ties)]]  # rotate among equals, so idle instances share work
        self._next += 1
        if self.routing == "least-loaded" or program_id is None:
            return least.instance_id
        choice = least
        home_id = self.homes.get(program_id)
        home = index.live_view(home_id) if home_id is not None else None
        if home is not None and (
            home.load == least.load  # as idle as any: a short call too keeps its prefix cache hit there
            or (num_tokens > self.locality_threshold and home.load - least.load <= self.max_imbalance)
        ):
            choice = home
        self.homes[program_id] = choice.instance_id
        return choice.instance_id

    def forget(self, dropped: Iterable[str], table: Container[str]) -> None:
        """Forget the homes of the programs the process table dropped (``dropped``) and does not hold again."""
        for pid in dropped:
            if pid not in table:
                self.homes.pop(pid, None)

    def drop_instance(self, instance_id: str) -> None:
        """Programs whose home died find a new one at their next call."""
        for pid in [p for p, i in self.homes.items() if i == instance_id]:
            del self.homes[pid]
