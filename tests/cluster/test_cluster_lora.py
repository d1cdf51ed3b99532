"""LoRA adapters on a 2-instance Ray cluster: every instance loads ``--lora-modules``, a request runs with its adapter
wherever it is routed, and after its instance dies it resumes on the other with the same adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
from one_engine import adapter_references
from streams import kill_mid_stream, stream_all

from boundless.api.launch import start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel
from boundless.model.random_model import write_random_lora

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.slow  # (10 s of Ray; the cluster's failover is test_cluster.py's, adapters' test_lora.py's)
def test_adapter_requests_survive_an_instance_death(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    import ray

    adapter = write_random_lora(tmp_path / "ad", tiny_llama.arch, rank=8, std=0.3)
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.05,
        enable_lora=True,
        lora_modules=(f"ad={adapter}",),
    )
    prompts = [[30 + i, 31, 32, 33, 34] for i in range(8)]
    max_tokens = 200
    per_call, expected = adapter_references(tiny_llama, config, prompts, max_tokens)  # one engine in this process
    models = [p.lora_name or "tiny" for p in per_call]

    if ray.is_initialized():
        ray.shutdown()
    cluster = ClusterConfig(instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, max_restarts=0)
    client = ClusterClient(config, cluster)
    server = start_in_thread(client, "tiny", loras={"ad": str(adapter)})
    try:
        texts = stream_all(server.url, prompts, max_tokens, kill_mid_stream(client, "1", max_tokens), models=models)
        assert client.dispatcher.num_failovers > 0  # the dead instance had streams in flight
        assert texts == expected
    finally:
        server.stop()
        client.shutdown()
        ray.shutdown()
