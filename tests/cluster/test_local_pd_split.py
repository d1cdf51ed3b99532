"""Prefill and decode engines of a model split over two tensor-parallel ranks (``cluster/local_pd.py``,
``kv/split_streams.py``): each rank streams its share of a call's KV to the decode engine's rank of its number, the
decode engine decodes from the blocks its ranks received (it computes no prompt again), and the answers are one split
engine's, token for token."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from boundless.cluster.local_pd import LocalPDCluster
from boundless.config import ClusterConfig
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, engine_config
from boundless.programs.ref import ProgramRef
from boundless.transport.endpoints import rank_address

MAX_TOKENS = 12
BLOCK = 16


def _whole_block_bytes(pd: LocalPDCluster) -> int:
    """A block's bytes over every key/value head of the model (float32), where a rank's share holds half of them."""
    arch = pd.instances["p0"].core.executor.runner.model.whole_arch
    return 2 * arch.num_layers * arch.num_kv_heads * BLOCK * arch.head_dim * 4


def _one_split_engines_texts(path: str, flags: dict, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    """The greedy answers of one engine split as the cluster's engines are."""
    one = LLM(path, **flags)
    try:
        return [out.outputs[0].text for out in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.close()


def _answers(
    pd: LocalPDCluster, tag: str, prompts: list[list[int]], params: SamplingParams, agents: bool = False
) -> list[tuple[str, set[str]]]:
    """Each prompt's text through the cluster, sent all at once (none ending in an error), and the engines it came
    from; with ``agents``, prompt ``i`` a call of program ``agent-i``."""

    async def call(rid: str, prompt: list[int], program: ProgramRef | None) -> tuple[str, set[str]]:
        text, instances = "", set()
        async for delta in pd.submit(rid, prompt, params, program):
            assert delta.finish_reason != "error", delta.stop_reason
            text += delta.new_text
            instances.add(delta.instance)
        return text, instances

    async def run() -> list[tuple[str, set[str]]]:
        calls = (call(f"{tag}{i}", p, ProgramRef(f"agent-{i}") if agents else None) for i, p in enumerate(prompts))
        return list(await asyncio.gather(*calls))

    return asyncio.run(asyncio.wait_for(run(), timeout=240))


def test_a_split_prefill_engine_hands_each_ranks_share_to_the_decode_engines_rank(model_dirs: dict[str, Path]) -> None:
    path = str(model_dirs["tiny-llama"])
    flags = dict(max_model_len=512, kv_cache_gb=0.02, tensor_parallel_size=2)
    prompts = [[40 + i] + [(17 * j + i) % 300 + 3 for j in range(36 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = _one_split_engines_texts(path, flags, prompts, params)

    pd = LocalPDCluster(engine_config(path, **flags), ClusterConfig(prefill_instances=1, decode_instances=1))

    try:
        addresses = {iid: inst.kv_address for iid, inst in pd.instances.items()}
        for address in addresses.values():  # (each rank an endpoint of its own, in a world of its rank's)
            assert rank_address(address, 0) != rank_address(address, 1)
        results = _answers(pd, "c", prompts, params)
        assert [text for text, _ in results] == expected
        assert all(instances == {"p0", "d0"} for _, instances in results)  # first token on the PE, the rest on the DE
        de = pd.instances["d0"].core.stats()
        full_blocks = sum(len(p) // BLOCK for p in prompts)
        assert de.remote_io is not None and de.remote_io.blocks_received == full_blocks
        assert de.remote_io.recv_failures == 0
        # Both ranks' shares came: the bytes of whole blocks (every key/value head), not rank 0's half of them.
        assert de.remote_io.bytes_received >= full_blocks * _whole_block_bytes(pd)
        # The decode engine computed each prompt's last partial block and its first token, not the prompts again.
        assert de.computed_tokens <= sum(len(p) % BLOCK + 1 + MAX_TOKENS for p in prompts)
    finally:
        pd.shutdown()


# (Each 9-15 s of engines split over processes: the slow suite; the first hand-off above is the fast suite's, a lost
# engine's restart test_local_pd_restart.py's.)
@pytest.mark.slow
@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_a_split_decode_engine_pushes_what_the_prefill_engine_lacks_rank_to_rank(
    model_dirs: dict[str, Path], tmp_path: Path, layerwise: str
) -> None:
    """DualPath's DE-read path, split: an agent's second turn is held by the decode engine that decoded its first (its
    output's KV), not by the prefill engine, so the decode engine's ranks push their shares of what the prefill
    engine's ranks lack, and the second turn's answer is one split engine's. With ``--layerwise-load on`` each push is
    counted first, and each prefill engine rank's forward pass copies the layers of its share as they land."""
    path = str(model_dirs["tiny-llama"])
    flags = dict(max_model_len=1024, kv_cache_gb=0.02, kv_host_gb=0.02, tensor_parallel_size=2)
    store = dict(kv_disk_path=str(tmp_path / "store"), kv_write_policy="through")
    contexts = [[40 + i] + [(19 * j + 7 * i) % 300 + 3 for j in range(100)] for i in range(3)]
    first = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    one = LLM(path, **flags)
    try:
        outputs = [list(out.outputs[0].token_ids) for out in one.generate(contexts, first, use_tqdm=False)]
        appends = [[(5 * j + i) % 300 + 9 for j in range(10)] for i in range(len(contexts))]
        turns = [c + o + a for c, o, a in zip(contexts, outputs, appends, strict=True)]
        expected = [out.outputs[0].text for out in one.generate(turns, first, use_tqdm=False)]
    finally:
        one.close()

    # (Emulated links: each engine a node of its own, whose store reads the dispatcher weighs against the other's.)
    # Layer by layer, a slow network (65 ms a layer of a push): the prefill engine's forward passes run as the layers
    # land, each rank copying its share's (whether one waits at a layer is the machine's timing: not asserted).
    net_gbps = 0.001 if layerwise == "on" else 10.0
    cluster = ClusterConfig(
        prefill_instances=1, decode_instances=1, kv_path="dualpath", storage_gbps=10.0, net_gbps=net_gbps
    )
    pd = LocalPDCluster(engine_config(path, **flags, **store, layerwise_load=layerwise), cluster)
    # What the prefill engine's manager hears: a counted push is counted (its blocks named, its request let run) once
    # every rank's count has come, before the push ends.
    ranks = pd.instances["p0"].core.executor.runner.ranks
    streams_done, counted = ranks.streams_done, []

    def recording(rank0, wait_s=0.0):
        report = streams_done(rank0, wait_s)
        counted.extend(report.counts)
        return report

    ranks.streams_done = recording

    try:
        _answers(pd, "t1-", contexts, first, agents=True)
        assert [text for text, _ in _answers(pd, "t2-", turns, first, agents=True)] == expected
        pe = pd.instances["p0"].core.stats()
        assert pe.remote_io is not None and pe.remote_io.blocks_received > 0  # the decode engine's pushes came
        assert pe.remote_io.recv_failures == 0
        assert pe.remote_io.bytes_received >= pe.remote_io.blocks_received * _whole_block_bytes(pd)  # every rank's
        assert (pe.remote_io.counted_recvs > 0) == (layerwise == "on")
        assert len(counted) == pe.remote_io.counted_recvs  # (every rank's count came: none held to the push's end)
    finally:
        pd.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["d0", "p0"])
def test_a_split_engine_that_loses_a_rank_is_restarted_and_hands_off_again(
    model_dirs: dict[str, Path], lost: str
) -> None:
    """An engine's rank 1 killed: a decode engine's calls fail over to the other decode engine, a lone prefill
    engine's wait for its restart, with nothing lost; the engine is restarted with fresh ranks, whose endpoints its
    peers reach again, and hands off again."""
    path = str(model_dirs["tiny-llama"])
    flags = dict(max_model_len=512, kv_cache_gb=0.02, tensor_parallel_size=2)
    # (Later calls with prompts of their own: the earlier ones' blocks are the decode engines' already, handed none.)
    prompts = [[60 + i] + [(13 * j + i) % 300 + 3 for j in range(40)] for i in range(6)]
    later = [[90 + i] + [(7 * j + i) % 300 + 3 for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = _one_split_engines_texts(path, flags, prompts + later, params)
    # (A heartbeat a second: one every 0.1 s could find d0 dead before the calls below were placed, none on it then.
    # A call placed on d0 fails over whether d0 is found dead before its handoff or after.)
    cluster = ClusterConfig(
        prefill_instances=1, decode_instances=2 if lost == "d0" else 1, heartbeat_interval_s=1.0,
        heartbeat_timeout_s=30.0, kv_handoff_timeout_s=20.0, restart_delay_s=0.5, max_restarts=1,
    )  # fmt: skip
    pd = LocalPDCluster(engine_config(path, **flags), cluster)

    try:
        ranks = pd.instances[lost].core.executor.runner.ranks
        assert ranks is not None
        ranks.processes[0].kill()
        ranks.processes[0].wait(10)
        first = _answers(pd, "a", prompts, params)
        assert [text for text, _ in first] == expected[: len(prompts)]
        deadline = time.monotonic() + 120
        while not (pd.dispatcher.views[lost].alive and pd.dispatcher.restarts.counts(lost)[0] == 1):
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.1)
        if lost == "d0":
            assert pd.dispatcher.num_failovers >= 1  # (the calls placed on d0 went on on d1)
        decoder = pd.instances["d0"].core  # (d0: the fresh engine, or the one the fresh PE hands off to)
        before = decoder.stats().remote_io
        assert before is not None
        results = _answers(pd, "b", later, params)
        assert [text for text, _ in results] == expected[len(prompts) :]
        assert any(lost in instances for _, instances in results)  # (the fresh engine took calls)
        after = decoder.stats().remote_io
        assert after is not None and after.blocks_received > before.blocks_received
        # (The first calls' streams from a lost PE failed, not these.)
        assert after.recv_failures == before.recv_failures
    finally:
        pd.shutdown()


@pytest.mark.slow  # (7 s of split engines)
def test_a_prefill_step_that_fails_before_its_forward_pass_ends_every_ranks_sends(model_dirs: dict[str, Path]) -> None:
    """Rank 0's step fails after its moves went to the ranks and before its forward pass: every rank's layerwise sends
    of the step fail with it (else the other ranks' stayed open, the send was never reported, and the prefill engine
    held its blocks until some other call came), and the next call hands off as ever."""
    path = str(model_dirs["tiny-llama"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cluster = ClusterConfig(prefill_instances=1, decode_instances=1, kv_handoff_timeout_s=5.0)
    pd = LocalPDCluster(engine_config(path, max_model_len=512, kv_cache_gb=0.02, tensor_parallel_size=2), cluster)
    pe = pd.instances["p0"].core
    executor = pe.executor
    layer_waits = executor._layer_waits
    failed: list[bool] = []

    def failing(sched):  # (called after the moves went to the ranks, before the forward pass)
        if not failed and any(send.layerwise for send in sched.remote_sends):
            failed.append(True)
            raise RuntimeError("injected: rank 0's step fails before its forward pass")
        return layer_waits(sched)

    executor._layer_waits = failing  # type: ignore[method-assign]

    async def call(rid: str, prompt: list[int]) -> list[tuple[str | None, str]]:
        return [(d.finish_reason, d.instance) async for d in pd.submit(rid, prompt, params)]

    try:
        prompt = [7] + [(11 * j) % 300 + 3 for j in range(40)]
        asyncio.run(asyncio.wait_for(call("a", prompt), timeout=120))
        assert failed
        deadline = time.monotonic() + 4.0  # (within the handoff's timeout: the failure is said, not waited out)
        while pe.kv.num_remote_in_flight or pe.kv.pool.num_used:
            assert time.monotonic() < deadline, "the failed step's sends are still held on the prefill engine"
            time.sleep(0.05)
        later = asyncio.run(asyncio.wait_for(call("b", prompt), timeout=120))
        assert later[-1][0] == "length" and {instance for _, instance in later} == {"p0", "d0"}
        assert pe.stats().remote_io.streams_sent >= 1
    finally:
        pd.shutdown()
