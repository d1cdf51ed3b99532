"""What is made from an object, kept for that very object: a request's samples share their params' tuples (stop
strings, a logit bias), so what the engine makes from a tuple is made once for all of them, not for each sample or
each step. Keyed by the object's identity, not its value (hashing a tuple of 400,000 strings is the cost saved); the
object is held with what was made of it, so its id cannot be reused while it is kept. Bounded: the least recently
used go first. Safe from several threads (the engines of one process)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IdentityCache(Generic[K, V]):
    """``make(key)`` for the last ``capacity`` keys used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[int, tuple[K, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[K], V]) -> V:
        with self._lock:
            found = self._kept.get(id(key))
            if found is not None and found[0] is key:
                self._kept.move_to_end(id(key))
                return found[1]
        made = make(key)  # (outside the lock: hundreds of milliseconds for a huge key)
        with self._lock:
            self._kept[id(key)] = (key, made)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return made
