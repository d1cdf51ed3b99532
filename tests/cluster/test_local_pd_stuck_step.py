"""Prefill and decode engines in this process (``cluster/local_pd.py``): an engine stuck inside a forward pass (its
loop's ``drain`` and ``heartbeat`` still answer) is found by the step watchdog, declared lost, and its call
completes on another engine of its role with the tokens one engine gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
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
    """A decode step of the victim call, a few tokens in (so that it fails over with tokens to resume from)."""
    return any(c.request_id == VICTIM and c.num_output_tokens >= 3 for c in sched.chunks)


def _prefilling_victim(sched: SchedulerOutput) -> bool:
    return any(c.request_id == VICTIM for c in sched.chunks)


@pytest.mark.parametrize(
    ("roles", "stuck_role", "catches"),
    [((1, 2), "d", _decoding_victim), ((2, 1), "p", _prefilling_victim)],
    ids=["decode-engine", "prefill-engine"],
)
def test_an_engine_stuck_in_a_step_is_lost_and_its_call_completes_elsewhere_with_one_engines_tokens(
    model_dirs: dict[str, Path],
    tiny_llama: LoadedModel,
    tmp_path: Path,
    roles: tuple[int, int],
    stuck_role: str,
    catches,
) -> None:
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.02,
        kv_host_gb=0.02,
        kv_disk_path=str(tmp_path / "store"),
    )
    # A tiny model's step takes milliseconds: 3 s in one step is stuck, even on a loaded machine.
    cluster = ClusterConfig(
        prefill_instances=roles[0],
        decode_instances=roles[1],
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=30.0,
        step_timeout_s=3.0,
        kv_handoff_timeout_s=20.0,
        max_restarts=0,  # the stuck engine stays lost (tests/cluster/test_local_pd_restart.py restarts one)
    )
    prompt = [(11 * j) % 300 + 3 for j in range(40)]
    pd = LocalPDCluster(config, cluster, tiny_llama)
    trap = HangTrap(catches)
    for iid, inst in pd.instances.items():
        if iid.startswith(stuck_role):
            inst.core.executor = HungExecutor(inst.core.executor, trap, iid)
    try:

        async def run() -> tuple[str, list[str]]:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            text, instances = "", []
            async for delta in pd.submit(VICTIM, prompt, params):
                assert delta.finish_reason != "error", delta.stop_reason
                text += delta.new_text
                instances.append(delta.instance)
            return text, instances

        # Without the watchdog the call waits for the stuck step for ever.
        text, instances = asyncio.run(asyncio.wait_for(run(), timeout=180))
        stuck = trap.caught_by
        assert stuck.startswith(stuck_role)
        assert not pd.dispatcher.views[stuck].alive
        assert all(view.alive for iid, view in pd.dispatcher.views.items() if iid != stuck)
        assert pd.dispatcher.num_failovers >= 1
        assert instances[-1] != stuck and instances[-1].startswith("d")  # decoded to its end by a live DE
        assert text == one_engine_texts(tiny_llama, [prompt], MAX_TOKENS)[0]
    finally:
        trap.release()
        pd.shutdown()
