"""Instances of a split model on Ray, each an actor whose rank 1 is a process of its own: ``--instances 2
--tensor-parallel-size 2`` (vLLM's data parallelism over tensor-parallel engines), whose greedy answers through the
server are one engine's and whose killed instance's streams fail over with nothing lost; and prefill and decode
engines of a split model, handing off rank to rank."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from one_engine import one_engine_texts
from served_cluster import served_cluster
from streams import complete_all, kill_mid_stream, stream_all

from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# (20 s of Ray and split engines: the cluster fails over in test_cluster.py, split engines answer in
# test_tensor_parallel_ranks.py.)
@pytest.mark.slow
def test_instances_of_a_split_model_answer_as_one_engine_and_fail_over(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05, tensor_parallel_size=2)
    cluster = ClusterConfig(instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, max_restarts=0)
    prompts = [[30 + i, 31, 32, 33, 34] for i in range(8)]
    max_tokens = 120
    with served_cluster(config, cluster) as (client, server):
        listed = httpx.get(server.url + "/cluster").json()["instances"]
        assert [i["state"] for i in listed] == ["alive", "alive"]
        texts = stream_all(server.url, prompts, max_tokens, kill_mid_stream(client, "1", max_tokens))
        assert client.dispatcher.num_failovers > 0  # the dead instance (and its rank) had streams in flight
        assert texts == one_engine_texts(tiny_llama, prompts, max_tokens)
        deadline = time.monotonic() + 10
        while client.dispatcher.views["1"].alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.dispatcher.views["1"].alive


@pytest.mark.slow  # (18 s of Ray and split engines; test_local_pd_split.py's hand off the same way)
def test_prefill_and_decode_engines_of_a_split_model_on_ray_hand_off_every_ranks_share(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    """``--prefill-instances 1 --decode-instances 1 --tensor-parallel-size 2``: each actor's two ranks stream their
    shares of a call's KV to the other's; the answers through the server are one engine's, and the handoff's bytes
    on the prefill engine's ``/metrics`` are the whole blocks' (both ranks' shares)."""
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=512, kv_cache_gb=0.02, tensor_parallel_size=2)
    cluster = ClusterConfig(prefill_instances=1, decode_instances=1, heartbeat_interval_s=0.2)
    prompts = [[40 + i] + [(17 * j + i) % 300 + 3 for j in range(47)] for i in range(4)]  # 3 full blocks each
    with served_cluster(config, cluster) as (_, server):
        assert [text for text, _ in complete_all(server.url, prompts, 10)] == one_engine_texts(tiny_llama, prompts, 10)
        arch = tiny_llama.arch
        whole_blocks = len(prompts) * 3 * 2 * arch.num_layers * arch.num_kv_heads * 16 * arch.head_dim * 4
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # (the heartbeat brings the engine's figures)
            metrics = httpx.get(server.url + "/metrics").text
            sent = re.search(r'boundless_pd_path_bytes_total\{instance="p0",path="handoff"[^}]*\} (\S+)', metrics)
            if sent is not None and float(sent.group(1)) >= whole_blocks:
                break
            time.sleep(0.2)
        assert sent is not None and float(sent.group(1)) >= whole_blocks
