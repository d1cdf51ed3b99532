"""Prefill and decode engines as Ray actors: a decode engine killed mid-stream is restarted as a fresh actor with its
old rank (its KV transport listens at the same address, and the prefill engine connects to it again), and decodes
later calls with one engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from one_engine import one_engine_texts
from served_cluster import served_cluster
from streams import complete_all, kill_mid_stream, stream_all, wait_for_state

from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
VICTIM = "d1"


# With an fp8 KV cache too: the handoffs, the failed-over calls and the restarted engine's carry 8-bit blocks as their
# bytes, and every output is one fp8 engine's.
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_killed_decode_engine_is_restarted_and_decodes_again(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, tmp_path: Path, kv: str
) -> None:
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.02,
        kv_host_gb=0.02,
        kv_disk_path=str(tmp_path / "store"),
        kv_cache_dtype=kv,
    )
    cluster = ClusterConfig(
        prefill_instances=1,
        decode_instances=2,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=30.0,
        kv_handoff_timeout_s=20.0,
        restart_delay_s=1.0,
    )
    with served_cluster(config, cluster) as (client, server):
        victim = client.instances[VICTIM].info
        assert victim is not None
        prompts = [[30 + i] + [(11 * j + i) % 300 + 3 for j in range(40)] for i in range(6)]
        max_tokens = 120

        texts = stream_all(server.url, prompts, max_tokens, kill_mid_stream(client, VICTIM, max_tokens))
        assert texts == one_engine_texts(tiny_llama, prompts, max_tokens, kv)
        entry = wait_for_state(server.url, VICTIM, "alive")
        assert entry["state"] == "alive" and entry["pid"] != victim.pid and entry["restarts"] == 1
        later_prompts = [[70 + i] + [(17 * j + i) % 300 + 3 for j in range(40)] for i in range(6)]

        served = complete_all(server.url, later_prompts, 16)
        assert [t for t, _ in served] == one_engine_texts(tiny_llama, later_prompts, 16, kv)
        assert f"boundless-{VICTIM}" in {f for _, f in served}  # decoded on the restarted engine
