"""Instances of a split model: ``--instances 2 --tensor-parallel-size 2`` on Ray (vLLM's data parallelism over
tensor-parallel engines), each instance an actor whose rank 1 is a process of its own: greedy answers through the
server are one engine's, and a killed instance's streams fail over with nothing lost."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from one_engine import one_engine_texts
from served_cluster import served_cluster
from streams import kill_mid_stream, stream_all

from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


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
