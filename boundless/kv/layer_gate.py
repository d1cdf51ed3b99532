"""Layerwise loads: a load's KV made usable layer by layer as its bytes arrive.

vLLM's KV connector API splits a load in two: ``start_load_kv`` before the forward pass, and
``wait_for_layer_load(layer)`` inside it, just before attention reads that layer's KV (LMCache's layerwise
mode implements it). A request whose KV is still arriving may then be scheduled: its prefill computes layer
``i`` while layers after ``i`` are still on the wire.

Here a :class:`LayerGate` is that pair for one load: the loader opens it layer by layer as the load's bytes
cross its link (the emulated storage NIC, ``cluster/links.py``), and the forward pass (or a sender pushing
the loaded blocks on to another instance) waits at layer ``i`` until layers ``0..i`` are open. A gate never
carries data: the blocks it guards are read, checksummed and in host memory before it is handed out (a
store file holds every layer of its block under one checksum, so no layer of it can be trusted before the
whole file is read). What a gate paces is the link, so exactness never rests on one, and a gate that does
not open in time is waited past (counted), never failed.

A gate over bytes that really are still on the wire (a DE-read push received layer by layer, ``kv/remote_io.py``)
is ``fallible``: its layers are copied as they land, so it is never waited past, and a stream that fails (its
sender gone, a timeout) fails the gate: a forward pass waiting at it raises :class:`LayerLost`, and the step's
requests lose their KV (``Scheduler.step_failed``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LayerLost(RuntimeError):
    """A layer a forward pass needs will never arrive: the stream carrying it failed."""


class LayerGate:
    """Layers ``0..opened-1`` of a load have arrived; :meth:`wait` blocks until a given layer has (or the gate has
    failed). ``fallible``: the layers are not here until they open (a stream's), so the gate is never waited past."""

    def __init__(self, num_layers: int, fallible: bool = False) -> None:
        self.num_layers = num_layers
        self.fallible = fallible
        self._opened = 0
        self._failed = False
        self._changed = threading.Condition()

    @property
    def failed(self) -> bool:
        with self._changed:
            return self._failed

    def fail(self) -> None:
        """The layers not yet open will never arrive."""
        with self._changed:
            self._failed = True
            self._changed.notify_all()

    @property
    def opened(self) -> int:
        with self._changed:
            return self._opened

    @property
    def is_open(self) -> bool:
        return self.opened >= self.num_layers

    def open_through(self, layer: int) -> None:
        """Layers up to and including ``layer`` have arrived."""
        with self._changed:
            if layer + 1 > self._opened:
                self._opened = min(layer + 1, self.num_layers)
                self._changed.notify_all()

    def open_all(self) -> None:
        self.open_through(self.num_layers - 1)

    def wait(self, layer: int, timeout_s: float) -> bool:
        """Wait until layer ``layer`` has arrived, ``timeout_s`` at most (less if the gate fails); returns whether it
        has."""
        with self._changed:
            self._changed.wait_for(lambda: self._opened > layer or self._failed, timeout=timeout_s)
            return self._opened > layer

    def wait_or_raise(self, layer: int, poll_s: float = 1.0) -> None:
        """Wait until layer ``layer`` has arrived, however long (the stream's own timeout fails the gate); raises
        :class:`LayerLost` if the gate fails first."""
        while not self.wait(layer, poll_s):
            if self.failed:
                raise LayerLost(f"layer {layer} of a stream will not arrive: its stream failed")


class LayerWaits:
    """The waits of one step's forward pass on the gates of the loads it reads: the hook the model calls before
    each layer, and what the waiting cost (seconds, and gates waited past after ``timeout_s``)."""

    def __init__(
        self, gates: list[LayerGate], timeout_s: float, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.gates = gates
        self.timeout_s = timeout_s
        self.clock = clock
        self.waited_s = 0.0
        self.timeouts = 0

    def before_layer(self, layer: int) -> None:
        for gate in self.gates:
            if gate.opened > layer:
                continue
            start = self.clock()
            if gate.fallible:
                try:
                    gate.wait_or_raise(layer)
                finally:
                    self.waited_s += self.clock() - start
                continue
            if not gate.wait(layer, self.timeout_s):
                # The bytes are in host memory already (the gate only paces their link): go on with them.
                self.timeouts += 1
                gate.open_all()
            self.waited_s += self.clock() - start
