"""A cluster of Ray actors behind a real server on 127.0.0.1, for the cluster tests' fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from boundless.api.launch import ServerThread, start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.config import ClusterConfig, EngineConfig


@contextmanager
def served_cluster(config: EngineConfig, cluster: ClusterConfig) -> Iterator[tuple[ClusterClient, ServerThread]]:
    """A cluster of Ray actors behind a real server, shut down after."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    client = ClusterClient(config, cluster)
    server = start_in_thread(client, "tiny")
    try:
        yield client, server
    finally:
        server.stop()
        client.shutdown()
        ray.shutdown()


@contextmanager
def ray_with_env(name: str, value: str) -> Iterator[None]:
    """Ray started afresh with ``name=value`` set (an instance's test hook), shut down after: the instances'
    environment comes from Ray's start-up, so a Ray already running would start them without it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(name, value)
        yield
        if ray.is_initialized():
            ray.shutdown()
