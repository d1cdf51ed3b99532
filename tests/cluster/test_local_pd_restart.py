"""Prefill and decode engines in this process (``cluster/local_pd.py``): a decode engine lost (stuck inside a forward
pass, found by the step watchdog) is restarted as a fresh engine of the same id and role, takes calls again once it
answers a heartbeat, and decodes later calls with one engine's greedy tokens; nothing is lost on the way."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from one_engine import one_engine_texts

from boundless.cluster.local_pd import LocalPDCluster
from boundless.config import ClusterConfig
from boundless.engine.hung_executor import HangTrap, HungExecutor
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

VICTIM = "victim"
MAX_TOKENS = 24


def _decoding_victim(sched: SchedulerOutput) -> bool:
    return any(c.request_id == VICTIM and c.num_output_tokens >= 3 for c in sched.chunks)


def test_a_lost_decode_engine_is_restarted_and_decodes_later_calls(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.02,
        kv_host_gb=0.02,
        kv_disk_path=str(tmp_path / "store"),
    )
    cluster = ClusterConfig(
        prefill_instances=1,
        decode_instances=2,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=30.0,
        step_timeout_s=3.0,  # a tiny model's step takes milliseconds: 3 s in one is stuck
        kv_handoff_timeout_s=20.0,
        restart_delay_s=0.5,
        max_restarts=1,
    )
    pd = LocalPDCluster(config, cluster, tiny_llama)
    trap = HangTrap(_decoding_victim)
    for iid, inst in pd.instances.items():
        if iid.startswith("d"):
            inst.core.executor = HungExecutor(inst.core.executor, trap, iid)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def call(rid: str, prompt: list[int]) -> tuple[str, str]:
        text, instance = "", ""
        async for delta in pd.submit(rid, prompt, params):
            assert delta.finish_reason != "error", delta.stop_reason
            text += delta.new_text
            instance = delta.instance
        return text, instance

    try:
        victim_prompt = [(11 * j) % 300 + 3 for j in range(40)]
        text, _ = asyncio.run(asyncio.wait_for(call(VICTIM, victim_prompt), timeout=180))
        lost = trap.caught_by
        assert lost.startswith("d") and pd.dispatcher.num_failovers >= 1
        assert text == one_engine_texts(tiny_llama, [victim_prompt], MAX_TOKENS)[0]
        # Restarted 0.5 s after its loss, alive again from its first heartbeat (without restarts: never).
        deadline = time.monotonic() + 60
        while not pd.dispatcher.views[lost].alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pd.dispatcher.views[lost].alive
        assert pd.dispatcher.restarts.counts(lost) == (1, 1, 0)
        fresh = pd.instances[lost]
        assert not isinstance(fresh.core.executor, HungExecutor)  # a new engine, not the stuck one
        # Later calls: the two decode engines share them, the restarted one too, each with one engine's tokens.
        prompts = [[50 + i] + [(13 * j + i) % 300 + 3 for j in range(30)] for i in range(6)]

        async def later() -> list[tuple[str, str]]:
            return list(await asyncio.gather(*(call(f"later{i}", p) for i, p in enumerate(prompts))))

        results = asyncio.run(asyncio.wait_for(later(), timeout=180))
        assert [t for t, _ in results] == one_engine_texts(tiny_llama, prompts, MAX_TOKENS)
        assert lost in {instance for _, instance in results}  # decoded to the end on the restarted engine
        assert fresh.core.stats().generation_tokens > 0
    finally:
        trap.release()
        pd.shutdown()


def test_a_decode_engine_whose_loop_stopped_is_lost_and_its_call_finishes_on_the_other(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    # An engine loop stopped by an error outside a step (taking a step's result: a bug there) answered heartbeats with
    # its last stats: the call on it waited for ever. Now its heartbeat fails, it is lost, and the call goes on.
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.02)
    cluster = ClusterConfig(
        prefill_instances=1, decode_instances=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0,
        kv_handoff_timeout_s=20.0, max_restarts=0,
    )  # fmt: skip
    pd = LocalPDCluster(config, cluster, tiny_llama)
    broken: list[str] = []
    for iid, inst in pd.instances.items():
        if iid.startswith("d"):
            finish_step = inst.core.finish_step

            def failing(sched, result, finish_step=finish_step, iid=iid):
                if not broken and any(c.request_id == VICTIM and c.num_output_tokens >= 3 for c in sched.chunks):
                    broken.append(iid)
                    raise KeyError("injected fault: a bug in taking a step's result")
                return finish_step(sched, result)

            inst.core.finish_step = failing  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def call(prompt: list[int]) -> str:
        text = ""
        async for delta in pd.submit(VICTIM, prompt, params):
            assert delta.finish_reason != "error", delta.stop_reason
            text += delta.new_text
        return text

    try:
        prompt = [(11 * j) % 300 + 3 for j in range(40)]
        text = asyncio.run(asyncio.wait_for(call(prompt), timeout=180))
        # The decode engine it started on broke (the first to decode it 3 tokens in); it ended on the other.
        assert len(broken) == 1 and not pd.dispatcher.views[broken[0]].alive and pd.dispatcher.num_failovers >= 1
        assert text == one_engine_texts(tiny_llama, [prompt], MAX_TOKENS)[0]
    finally:
        pd.shutdown()
