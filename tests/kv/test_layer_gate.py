"""A layerwise load's gate: layers open in order, a wait returns once its layer has arrived, and the waits of a
forward pass go past a gate that does not open in time (counted) rather than hang."""

from __future__ import annotations

import threading

from boundless.kv.layer_gate import LayerGate, LayerWaits


def test_a_wait_returns_once_its_layer_has_arrived_from_another_thread() -> None:
    gate = LayerGate(4)
    assert not gate.wait(0, timeout_s=0.0)
    opener = threading.Thread(target=gate.open_through, args=(1,))
    opener.start()
    assert gate.wait(1, timeout_s=30.0)
    opener.join()
    assert gate.opened == 2 and not gate.is_open
    assert not gate.wait(2, timeout_s=0.0)
    gate.open_through(0)  # never closes again
    assert gate.opened == 2
    gate.open_all()
    assert gate.is_open and gate.wait(3, timeout_s=0.0)


def test_a_forward_pass_waits_at_each_layer_and_goes_past_a_stalled_gate_once() -> None:
    ready, stalled = LayerGate(3), LayerGate(3)
    ready.open_all()
    stalled.open_through(0)
    waits = LayerWaits([ready, stalled], timeout_s=0.05)
    waits.before_layer(0)  # both have layer 0: no wait
    assert waits.timeouts == 0 and waits.waited_s == 0.0
    waits.before_layer(1)  # the stalled gate times out: it is opened, and never waited for again
    assert waits.timeouts == 1 and stalled.is_open and waits.waited_s > 0
    waits.before_layer(2)
    assert waits.timeouts == 1
