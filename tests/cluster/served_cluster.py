"""A cluster of Ray actors behind a real server on 127.0.0.1, for the cluster tests' fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
