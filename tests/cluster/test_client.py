"""The Ray front end (``cluster/client.py``) as an operator reads it: ``GET /cluster`` and the server's output of a
2-instance cluster behind a real server, one of whose instances is lost with calls on it (its engine hangs in a decode
step, the instances' test hook, and the step watchdog kills it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from served_cluster import ray_with_env

from boundless.api.launch import start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.cluster.instance import HANG_STEP_ENV
from boundless.config import ClusterConfig
from boundless.llm import engine_config

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
STUCK = "1"


@pytest.fixture(scope="module")
def ray_with_a_hanging_instance() -> Iterator[None]:
    with ray_with_env(HANG_STEP_ENV, STUCK):
        yield


def test_a_lost_instance_shows_no_calls_running_or_waiting_on_it(
    model_dirs: dict[str, Path], ray_with_a_hanging_instance: None, capfd: pytest.CaptureFixture[str]
) -> None:
    # Before, /cluster showed a dead instance with the calls of its last heartbeat running and waiting for good (it
    # held none: they had failed over), and its KV in use: an operator read calls stuck on a dead engine.
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05)
    cluster = ClusterConfig(
        instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, step_timeout_s=3.0, max_restarts=0
    )
    client = ClusterClient(config, cluster)
    server = start_in_thread(client, "tiny")
    try:

        async def run() -> list[str]:
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

            async def one(i: int) -> str:
                reply = await api.completions.create(
                    model="tiny", prompt=[40 + i, 41, 42, 43, 44], max_tokens=24, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                return reply.choices[0].finish_reason

            reasons = await asyncio.gather(*(one(i) for i in range(6)))
            await api.close()
            return list(reasons)

        assert asyncio.run(asyncio.wait_for(run(), timeout=240)) == ["length"] * 6  # every call finished elsewhere
        assert client.dispatcher.num_failovers > 0  # some were on the stuck instance when it was lost
        instances = {i["id"]: i for i in httpx.get(server.url + "/cluster", timeout=10).json()["instances"]}
        lost = instances[STUCK]
        assert lost["state"] == "dead" and lost["lost"] == 1
        assert (lost["running"], lost["waiting"], lost["inflight"], lost["kv_usage"]) == (0, 0, 0, 0.0)
        assert instances["0"]["state"] == "alive"
        # The actors' log lines reach the server's output saying which instance wrote them, at which level (under
        # the actor's pid alone before, a number the server's log never tied to an instance).
        out = capfd.readouterr()
        hook = [line for line in (out.out + out.err).splitlines() if "test hook" in line]
        assert hook and f"ERROR instance {STUCK} boundless.cluster.instance: test hook" in hook[0]
    finally:
        server.stop()
        client.shutdown()
