"""A 2-instance Ray cluster behind a real server, one of whose actors is killed mid-stream: its calls finish on the
other with one engine's greedy tokens, a fresh actor is started in its place once the restart is due, and later
calls are routed to it again; ``/cluster`` and ``/metrics`` report the restart."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from one_engine import one_engine_texts
from streams import complete_all, kill_mid_stream, stream_all, wait_for_state

from boundless.api.launch import start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.cluster.restarts import Restart
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
VICTIM = "1"


def test_a_killed_instance_is_restarted_and_takes_calls_again(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    import ray

    if ray.is_initialized():  # a Ray of another module's test hooks
        ray.shutdown()
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05)
    cluster = ClusterConfig(
        instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, restart_delay_s=1.0, max_restarts=2
    )
    client = ClusterClient(config, cluster)
    server = start_in_thread(client, "tiny")
    prompts = [[30 + i, 31, 32, 33, 34] for i in range(8)]
    max_tokens = 200
    try:
        victim = client.instances[VICTIM].info
        assert victim is not None

        # Every call finishes once, with its tokens: those on the killed instance resumed on the other.
        texts = stream_all(server.url, prompts, max_tokens, kill_mid_stream(client, VICTIM, max_tokens))
        assert client.dispatcher.num_failovers > 0
        assert texts == one_engine_texts(tiny_llama, prompts, max_tokens)
        # The restart: a new actor (another process) in its place, alive from its first heartbeat.
        entry = wait_for_state(server.url, VICTIM, "alive")
        assert entry["state"] == "alive" and entry["pid"] != victim.pid  # without restarts: dead for good
        assert (entry["lost"], entry["restarts"], entry["failed_restarts"]) == (1, 1, 0)
        metrics = httpx.get(server.url + "/metrics").text
        assert f'boundless_instance_restarts_total{{instance="{VICTIM}"}} 1.0' in metrics
        # Later calls go to both instances again, with one engine's tokens.
        later_prompts = [[60 + i, 61, 62] for i in range(8)]

        served = complete_all(server.url, later_prompts, 16)
        assert [t for t, _ in served] == one_engine_texts(tiny_llama, later_prompts, 16)
        assert f"boundless-{VICTIM}" in {f for _, f in served}
    finally:
        server.stop()
        client.shutdown()
        ray.shutdown()


def test_a_restart_decided_as_the_cluster_shuts_down_starts_nothing(model_dirs: dict[str, Path]) -> None:
    """A restart whose thread runs after the client shut down (the heartbeat loop decided it just before) starts no
    actor: one started then would start Ray again in this process, after the caller's ``ray.shutdown()``. Found so in
    the lending cluster's tests: a second Ray session in pytest's process, whose loss ended the process a minute
    later."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05)
    client = ClusterClient(config, ClusterConfig(instances=2, heartbeat_interval_s=0.2, max_restarts=2))
    started: list[str] = []
    start = client._start_actor
    client._start_actor = lambda iid: started.append(iid) or start(iid)
    client.shutdown()
    ray.shutdown()
    client._restart(Restart(VICTIM, 1))
    for thread in threading.enumerate():
        if thread.name == f"boundless-restart-{VICTIM}":
            thread.join(timeout=30)
    assert started == [] and not ray.is_initialized()


def test_restarts_keep_no_thread_of_the_actors_they_replaced(model_dirs: dict[str, Path]) -> None:
    """Each restart starts a poller for the new actor; the lost actor's, which ended with it, is not kept. A soak
    that killed an engine actor ten times found the client holding thirteen threads, ten of them finished."""
    import os
    import signal
    import time

    import ray

    if ray.is_initialized():
        ray.shutdown()
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05)
    cluster = ClusterConfig(
        instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, restart_delay_s=0.2, max_restarts=10
    )
    client = ClusterClient(config, cluster)
    try:
        kept = len(client._threads)  # a poller per instance and the heartbeats
        for kill in range(3):
            info = client.instances[VICTIM].info
            assert info is not None
            os.kill(info.pid, signal.SIGKILL)
            deadline = time.monotonic() + 180
            while True:
                with client.lock:
                    inst = client.instances[VICTIM]
                    back = client.dispatcher.views[VICTIM].alive and inst.info is not None and inst.info.pid != info.pid
                if back:
                    break
                assert time.monotonic() < deadline, f"instance {VICTIM} did not come back after kill {kill + 1}"
                time.sleep(0.1)
        assert client.dispatcher.restarts.counts(VICTIM) == (3, 3, 0)
        assert len(client._threads) == kept
        assert all(t.is_alive() for t in client._threads)
    finally:
        client.shutdown()
        ray.shutdown()
