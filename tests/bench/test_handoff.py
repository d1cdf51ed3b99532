"""``bench handoff`` on a tiny model: both modes run and hand every request off; the baseline's stream is all
after the forward pass. (How much the layerwise stream hides needs a real model: a tiny one's forward pass
is over before the sender wakes.)"""

from __future__ import annotations

from boundless.bench.handoff import measure
from boundless.model.loader import LoadedModel


def test_both_modes_hand_off_and_the_baseline_streams_after_the_forward_pass(tiny_llama: LoadedModel) -> None:
    rows = {r["mode"]: r for r in measure(tiny_llama, [96], net_gbps=0.05, repeats=1)}
    layerwise, after = rows["layerwise"], rows["after"]
    assert layerwise["kv_mb"] == after["kv_mb"]
    assert after["exposed_s"] >= after["stream_s"] > 0 and after["hidden"] == 0  # all of it after the pass
    assert layerwise["stream_s"] > 0 and 0 <= layerwise["hidden"] <= 1
