"""``boundless bench longctx`` on a tiny random model: the three setups serve the same trace of short requests and
contexts up to 2.5 pools on 3 instances, with the same greedy outputs; only lending serves what exceeds one pool,
and it moves fewer bytes than moving whole contexts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from boundless.bench import longctx
from boundless.bench.longctx_trace import TraceShape, make_trace
from boundless.cli import build_parser
from boundless.config import ConfigError, engine_config_from_flags
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel


def test_trace_mixes_short_requests_with_contexts_over_one_pool() -> None:
    shape = TraceShape(num_short=10, long_factors=(0.75, 2.5), short_first=3)
    offline = make_trace(shape, pool_tokens=512, vocab_size=300, rate=0.0, seed=1)
    online = make_trace(shape, pool_tokens=512, vocab_size=300, rate=5.0, seed=1)
    assert [r.prompt for r in offline] == [r.prompt for r in online]  # arrivals drawn apart from lengths
    assert all(r.arrival_s == 0 for r in offline) and online[-1].arrival_s > 0
    assert not any(r.long for r in offline[:3])
    assert sorted(len(r.prompt) for r in offline if r.long) == [384, 1280]
    assert all(len(r.prompt) <= 192 for r in offline if not r.long)


@pytest.mark.parametrize("num_short", [0, 2, 4, 6])
def test_a_short_trace_keeps_every_long_request(num_short: int) -> None:
    """Fewer short requests than the trace's head (6 by default) still give every long one, in order: each had fallen
    on one place, and the trace had one long request (``bench longctx --num-short 4``)."""
    trace = make_trace(TraceShape(num_short=num_short), pool_tokens=100, vocab_size=300, rate=0.0)
    assert [len(r.prompt) for r in trace if r.long] == [75, 150, 250]
    assert len(trace) == num_short + 3


def test_every_setup_serves_the_trace_with_identical_outputs(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["bench", "longctx", "--model", str(model_dirs["tiny-llama"]), "--instances", "3", "--num-kv-blocks", "24",
         "--chunk-tokens", "64", "--num-short", "10", "--long-factors", "0.75,2.5", "--rate", "0",
         "--out-dir", str(tmp_path)]
    )  # fmt: skip
    result = longctx.run(args)
    by = {r["setup"]: r for r in result["rows"]}
    assert list(by) == list(longctx.SETUPS)
    assert result["outputs_identical"] and result["outputs_compared"] == 11  # the shorts and the 0.75-pool one
    pool = 24 * 16
    for r in by.values():
        assert r["requests"] == 12 and not r["gave_up"] and r["tok_s"] > 0
        assert r["served"] + r["rejected"] + r["unserved"] == 12
    # One pool at most without lending: the 2.5-pool request is rejected at admission.
    for name in ("separate", "move"):
        assert by[name]["served"] == 11 and by[name]["rejected"] == 1 and by[name]["round_trips"] == 0
        assert by[name]["longest_context"] <= pool
    assert by["separate"]["moves"] == 0 and by["separate"]["mb_moved"] == 0
    # Lending serves it across instances, attending to its moved blocks through partials.
    lending = by["lending"]
    assert lending["served"] == 12 and lending["rejected"] == 0 and lending["long_served"] == 2
    assert lending["longest_context"] > 2 * pool and lending["round_trips"] > 0 and lending["moves"] > 0
    assert result["goals"]["lending_longest_x_pool"] > 2
    saved = json.loads((tmp_path / "longctx.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert (tmp_path / "longctx.csv").read_text().count("\n") == len(result["rows"]) + 1


def test_a_step_that_only_evicts_wakes_the_instances_waiting_for_a_change(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    """A step that computes nothing but evicts its request (it cannot grow: the rest of its pool holds blocks lent
    to another instance's request) frees blocks here and on its creditors: the instances waiting for a change must
    step again. The emulated loop took it for a step that changed nothing and left them waiting, so a run could end
    with work that could now run (docs/distributed-attention.md, run D)."""
    args = build_parser().parse_args(["bench", "longctx", "--model", str(model_dirs["tiny-llama"])])
    base = engine_config_from_flags(args)
    config = longctx.LongCtxConfig(instances=2, num_kv_blocks=16, chunk_tokens=64)
    cluster = longctx.LongCtxCluster("lending", load("tiny-llama"), base, config, tmp_path)
    try:
        a, b = cluster.instances
        assert a.agent is not None and b.agent is not None
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        # On a: 12 blocks of prompt, prefilled, then 11 of them lent to b.
        a.core.add_request("long", list(range(3, 3 + 192)), params)
        while a.core.scheduler.requests["long"].num_computed_tokens < 192:
            a.agent.step()
        assert a.agent.move_kvcache("long", 11, b.transport.address)
        # On b: a request of the 5 blocks left, prefilled; its first decode needs a sixth, and b has none.
        b.core.add_request("short", list(range(3, 3 + 80)), dataclasses.replace(params, max_tokens=16))
        while b.core.scheduler.requests["short"].num_computed_tokens < 80:
            b.agent.step()
        assert b.core.kv.pool.num_free == 0
        a.waiting_for_change = True  # (as after a step of a that could do nothing)
        computed = b.core.counters.computed_tokens
        assert cluster.step(b) == []
        assert b.core.counters.computed_tokens == computed and b.core.scheduler.stats.num_preemptions == 1
        assert not a.waiting_for_change and not b.waiting_for_change
    finally:
        cluster.close()


def test_a_step_budget_the_attention_backend_cannot_take_names_chunk_tokens(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The instances' step budget is the command's ``--chunk-tokens``: the engine's refusal named
    ``--max-num-batched-tokens``, a flag the command refuses."""
    args = build_parser().parse_args(
        ["bench", "longctx", "--model", str(model_dirs["tiny-llama"]), "--attention-backend", "flex",
         "--num-kv-blocks", "100000", "--chunk-tokens", "100000", "--num-short", "1", "--setups", "separate",
         "--out-dir", str(tmp_path)]
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--chunk-tokens") as refused:
        longctx.run(args)
    assert "--max-num-batched-tokens" not in str(refused.value)
