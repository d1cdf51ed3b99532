"""A layerwise load's gate: layers open in order, a wait returns once its layer has arrived, and the waits of a
forward pass go past a gate that does not open in time (counted) rather than hang; a stream's (fallible) gate is
waited for until it opens or fails, and a failed one raises."""

from __future__ import annotations

import threading

import pytest

from boundless.kv.layer_gate import LayerGate, LayerLost, LayerWaits


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


def test_a_fallible_gate_is_never_waited_past_and_a_failed_one_raises_at_its_missing_layer() -> None:
    stream = LayerGate(3, fallible=True)
    stream.open_through(0)
    waits = LayerWaits([stream], timeout_s=0.01)
    waits.before_layer(0)  # landed: no wait
    failer = threading.Timer(0.05, stream.fail)  # past the waits' timeout: a fallible gate is still waited for
    failer.start()
    with pytest.raises(LayerLost):
        waits.before_layer(1)
    failer.join()
    assert stream.failed and stream.opened == 1 and waits.timeouts == 0
    assert stream.wait(0, timeout_s=0.0) and not stream.wait(1, timeout_s=0.0)  # what landed stays landed
