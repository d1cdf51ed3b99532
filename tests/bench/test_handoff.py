"""``bench handoff`` on a tiny model: both modes run and hand every request off; the baseline's stream is all
after the forward pass. (How much the layerwise stream hides needs a real model: a tiny one's forward pass
is over before the sender wakes.)"""

from __future__ import annotations

from boundless.bench.handoff import measure, measure_push, measure_receive
from boundless.model.loader import LoadedModel


def test_both_modes_hand_off_and_the_baseline_streams_after_the_forward_pass(tiny_llama: LoadedModel) -> None:
    rows = {r["mode"]: r for r in measure(tiny_llama, [96], net_gbps=0.05, repeats=1)}
    layerwise, after = rows["layerwise"], rows["after"]
    assert layerwise["kv_mb"] == after["kv_mb"]
    assert after["exposed_s"] >= after["stream_s"] > 0 and after["hidden"] == 0  # all of it after the pass
    assert layerwise["stream_s"] > 0 and 0 <= layerwise["hidden"] <= 1


def test_the_receive_side_loads_the_whole_context_in_both_modes_and_only_layerwise_waits_per_layer(
    tiny_llama: LoadedModel,
) -> None:
    rows = {r["mode"]: r for r in measure_receive(tiny_llama, [96], append=16, storage_gbps=0.0005, repeats=1)}
    whole, layerwise = rows["whole"], rows["layerwise"]
    assert whole["link_s"] == layerwise["link_s"] > 0  # the same bytes loaded
    assert whole["layer_wait_s"] == 0 and whole["admitted_s"] >= whole["link_s"]  # it ran after the whole load
    assert layerwise["layer_wait_s"] > 0, rows  # it ran while the link carried the load, waiting at the layers
    assert whole["ttft_s"] > 0 and layerwise["ttft_s"] > 0


def test_the_de_read_push_lands_its_whole_context_in_every_mode(tiny_llama: LoadedModel) -> None:
    rows = {r["mode"]: r for r in measure_push(tiny_llama, [96], 16, storage_gbps=0.002, net_gbps=0.002, repeats=1)}
    whole, layerwise = rows["whole"], rows["layerwise"]
    assert whole["storage_s"] == layerwise["storage_s"] > 0  # the same six blocks loaded and pushed
    # Whole, the push starts once the DE's storage link has carried the load: it lands after both links' time.
    assert whole["landed_s"] >= whole["storage_s"] + whole["net_s"]
    assert 0 < layerwise["landed_s"] <= layerwise["ttft_s"]
    # The PE waits for the whole push unless it prefills as the push lands: then it runs the request before the push
    # has landed, its forward pass waiting at layers not yet there.
    assert whole["layer_wait_s"] == layerwise["layer_wait_s"] == 0
    overlap = rows["layerwise+pe"]
    assert overlap["admitted_s"] < overlap["landed_s"] and overlap["layer_wait_s"] > 0
