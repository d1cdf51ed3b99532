"""DistAttention across engines in one process over a real shared-memory transport: a debtor moves leading blocks
of a request to one or two creditors mid-prefill and mid-decode, and goes on with its prefill chunks and decodes
attending to them there. Greedy outputs equal one engine's holding everything, and the logits agree to 1e-4."""

from __future__ import annotations

import pytest
import torch
from lending_helpers import BLOCK, CHUNK, LONG, OTHER, PARAMS, SHARED, Recorded, record, reference

from boundless.attention import cpu_attention, triton_paged
from boundless.engine.core import EngineCore


def _computed(core: EngineCore, rid: str) -> int:
    return core.scheduler.requests[rid].num_computed_tokens


def _assert_same(got: Recorded, want: Recorded, rids: list[str]) -> None:
    for rid in rids:
        assert got.tokens[rid] == want.tokens[rid], rid
        for i in range(len(want.tokens[rid])):
            torch.testing.assert_close(got.logits[(rid, i)], want.logits[(rid, i)], atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])  # GQA, MHA
@pytest.mark.parametrize("instances", [2, 3])
def test_distattention_matches_one_instance(load, make_cluster, model: str, instances: int) -> None:
    _spanning_request_matches_one_instance(load(model), make_cluster, instances)


def test_distattention_on_the_pytorch_attention_path(load, make_cluster, monkeypatch) -> None:
    """The same without the native kernel: local partials from the PyTorch path, creditors' from matmuls."""
    monkeypatch.setattr(cpu_attention, "supports", lambda head_dim, device: False)
    _spanning_request_matches_one_instance(load("tiny-llama"), make_cluster, 3)


# In Triton's interpreter on the CPU, ~15 s: the slow suite there (the kernels' partials and merge are checked in the
# fast one, tests/attention/test_triton_paged.py); on CUDA it runs in scripts/gpu-check.sh.
@pytest.mark.slow
def test_distattention_on_the_triton_kernels(load, make_cluster) -> None:
    """The local partials from the GPU backend's kernels (here in Triton's interpreter): their log-sum-exp is the
    partial's max, merged with the creditors' as the other backends' partials are."""
    loaded = load("tiny-llama")
    if not triton_paged.available(loaded.device):
        pytest.skip("triton unavailable")
    _spanning_request_matches_one_instance(loaded, make_cluster, 2, attention_backend="triton")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_distattention_over_an_8_bit_kv_cache(load, make_cluster, kv: str) -> None:
    """Blocks lent as their 8-bit bytes, the creditors' partials scoring over them (widened, as the debtor reads its
    own): the logits of one engine with the same 8-bit cache."""
    _spanning_request_matches_one_instance(load("tiny-llama"), make_cluster, 3, kv_cache_dtype=kv)


def test_distattention_on_flex_attention(load, make_cluster) -> None:
    """The local partials from FlexAttention's log-sum-exp, merged with the creditors' (the eager reference here,
    the compiled kernel on CUDA)."""
    _spanning_request_matches_one_instance(load("tiny-llama"), make_cluster, 2, attention_backend="flex")


@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_distattention_with_attention_sinks(load, make_cluster, backend: str) -> None:
    """gpt-oss's sinks are one more key of every row, merged once after the creditors' partials and the local one
    (``DistributedAttention.forward_partial``): one engine's outputs. Its windowed first layer asks no creditor, its
    second does."""
    _spanning_request_matches_one_instance(load("tiny-gpt-oss"), make_cluster, 2, attention_backend=backend)


def _spanning_request_matches_one_instance(
    loaded, make_cluster, instances: int, attention_backend: str = "torch", kv_cache_dtype: str = "auto",
    asks: bool = True,
) -> None:  # fmt: skip
    want = reference(loaded, {"long": LONG, "shared": SHARED, "other": OTHER}, kv_cache_dtype=kv_cache_dtype)
    cluster = make_cluster(loaded, instances, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
    debtor, creditors = cluster.agents[0], cluster.agents[1:]
    recs = [Recorded() for _ in cluster.agents]
    for agent, rec in zip(cluster.agents, recs, strict=True):
        record(agent.core, rec)
    debtor.core.add_request("long", LONG, PARAMS)
    creditors[0].core.add_request("other", OTHER, PARAMS)  # the creditor serves its own request meanwhile
    second = creditors[-1].instance_id
    # Prefill: after 2 chunks (4 full blocks), blocks 0-1 go to the first creditor; the next chunks attend to them.
    while _computed(debtor.core, "long") < 2 * CHUNK:
        cluster.step_all(recs)
    assert debtor.move_kvcache("long", 2, creditors[0].instance_id)
    cluster.step_all(recs)  # a prefill chunk over remote blocks
    assert _computed(debtor.core, "long") == 3 * CHUNK
    # Block 2 goes to the last creditor (the same one on 2 instances: two spans there).
    assert debtor.move_kvcache("long", 1, second)
    debtor.core.add_request("shared", SHARED, PARAMS)  # hits the prefix cache: LONG's first 3 blocks, still named
    while len(recs[0].tokens.get("long", [])) < 4:
        cluster.step_all(recs)
    # Mid-decode: two more blocks to the first creditor.
    assert debtor.move_kvcache("long", 2, creditors[0].instance_id)
    first, remote = debtor.core.kv.remote_prefix("long")
    assert first == 5 and sum(kv.num_tokens for kv in remote) == 5 * BLOCK
    assert {kv.creditor for kv in remote} == {c.instance_id for c in creditors}
    while any(a.core.has_unfinished() for a in cluster.agents):
        cluster.step_all(recs)
    got = Recorded(tokens={**recs[0].tokens, **recs[1].tokens}, logits={**recs[0].logits, **recs[1].logits})
    _assert_same(got, want, ["long", "shared", "other"])
    assert recs[0].cached["shared"] == 3 * BLOCK  # a prefix-cache hit on the debtor, beside the remote request
    # Every layer of every step of "long" after the first move asked its creditors (``asks``; else its windows all
    # started past the lent blocks): round trips happened.
    assert (debtor.data.client.stats.round_trips > 0) == asks and debtor.data.attention.stats.layers > 0
    # The request finished: its creditors freed its blocks; nothing is left lent anywhere.
    for c in creditors:
        assert not c.rm.loans and c.core.kv.pool.num_used == 0
    assert debtor.stats.blocks_out == 5 and sum(c.stats.blocks_in for c in creditors) == 5


@pytest.mark.parametrize(("model", "window", "instances"), [
    ("tiny-mistral-window", 12, 2), ("tiny-mistral-window", 40, 2), ("tiny-mistral-window", 40, 3),
    ("tiny-qwen2-window", 7, 2),
])  # fmt: skip
def test_distattention_within_sliding_windows(
    load, make_cluster, monkeypatch, model: str, window: int, instances: int
) -> None:
    """Layers with a sliding window: 12 keys, less than the lent blocks' distance to every later chunk (no layer
    asks a creditor), 40 keys (the rows just past the lent blocks see some of them: the creditor masks its keys by
    the positions the segments carry; on 3 instances the first creditor holds two runs of the request's blocks, the
    second's between them, each masked by its own positions), and 7 keys after a first layer of the whole context
    (only that one asks). The outputs are one engine's."""
    loaded = load(model)
    for layer in loaded.model.layers:
        if layer.window is not None:
            monkeypatch.setattr(layer, "window", window)
    asks = window > 12 or model == "tiny-qwen2-window"
    _spanning_request_matches_one_instance(loaded, make_cluster, instances, asks=asks)
